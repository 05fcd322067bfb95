"""The training data's samples, rarefied once and kept on disk, read a sample at a time.

`<cache_dir>/samples/<key>/` holds each sample's rarefied observations and counts and, with a tree, its
branch set (batch UniFrac) as raw int32 files (`rows`, `reads`, `branches`: one after another), and an
`index.npz` written last (ids, offsets, real-token counts, targets, the token table, branch lengths, and
each raw file's CRC-32, checked when the store is opened: a file damaged in place, its length unchanged,
is found and the store rebuilt; the check reads the files once, about 1.7 GB/s on one core).
The key is the sha256 of the files' content and of the options that shape the samples (data.rarefy_depth,
data.seed, data.max_asvs, data.target). The store is built in one pass over the table, `CHUNK_SAMPLES`
samples at a time (an HDF5 table: only that chunk's counts in memory), and each sample is read back with
one positioned read per file: memory holds the offsets and the token table, not the samples."""

import contextlib
import hashlib
import logging
import multiprocessing
import secrets
import shutil
import sys
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from aamperf.cgroups import core_budget
from aamperf.data.branches import Branches, read_branches
from aamperf.data.metadata import read_target
from aamperf.data.samples import (
    Chunk,
    Ragged,
    SampleDataset,
    Samples,
    keep_asvs_by,
    no_sample_deep_enough,
    rarefy_chunk,
    table_tokens,
    warn_sequences_cut,
    warn_too_shallow,
    warn_without_target,
)
from aamperf.data.tables import table_chunks, table_ids
from aamperf.data.trees import warn_missing_lengths
from aamperf.errors import UserError, disk_full, no_space
from aamperf.files import one_builder, replace_durably, sha256_of
from aamperf.tokens import ASV_BP

log = logging.getLogger(__name__)

STORE_VERSION = 2  # part of the key: bump when what is stored, or how it is computed, changes
CHUNK_SAMPLES = 10_000  # samples rarefied at a time while the store is built
# Worker processes from this many chunks on: each costs seconds to start (its imports), a chunk about a
# second of one core. A fixed threshold measured on one machine (experiments/data_scale/store_workers.py,
# 2-core AMD EPYC, 100k samples = 10 chunks: 7.7 / 7.0 s with 2 workers, 6.8 / 6.5 s without): re-measure
# it on machines with more cores, where workers pay sooner.
PARALLEL_FROM_CHUNKS = 20
PROGRESS_AFTER_S = 2.0  # the build's progress bar appears once it has taken this long
FIX = "free space, or set data.cache_dir elsewhere"
RAGGED = ("rows", "reads", "branches")  # int32 files; rows and reads share the offsets `rows_ptr`
CHECKSUM_BLOCK_BYTES = 1 << 22  # a raw file is checksummed this much at a time: memory stays flat


def sample_store(cfg: DictConfig, files: dict, with_branches: bool) -> tuple[Samples, bool]:
    """The samples of the `data` config from their store, built first if missing: (samples, cached)."""
    path = Path(cfg.cache_dir).expanduser() / "samples" / store_key(cfg, files, with_branches)
    cached = damage(path) is None
    if not cached:
        with one_builder(path.parent):  # another process building it: wait, then read its store
            problem = damage(path)
            cached = problem is None
            if not cached:
                if path.exists():
                    log.warning("sample store %s is damaged (%s): rebuilding it", path, problem)
                build_store(cfg, files, with_branches, path)
    return open_store(path, cfg, files), cached


def store_key(cfg: DictConfig, files: dict, with_branches: bool) -> str:
    h = hashlib.sha256(f"samples v{STORE_VERSION}|".encode())
    options = (cfg.rarefy_depth, cfg.seed, cfg.max_asvs, cfg.target, with_branches)
    if cfg.target is not None and cfg.get("target_type") == "classification":  # a number's class index
        options += ("classification",)
    h.update(repr(options).encode())
    for name in ("table", "sequences", "metadata", "tree"):
        used = (
            files[name] is not None
            and (name != "tree" or with_branches)
            and (name != "metadata" or cfg.target)
        )
        h.update(f"|{name}:{sha256_of(files[name]) if used else '-'}".encode())
    return h.hexdigest()


def damage(path: Path) -> str | None:
    """What keeps `path` from being a whole store, or None: its index (written last; a zip whose members'
    CRCs are checked) of this version, and each raw file as long as the index says and of its CRC-32."""
    try:
        with np.load(path / "index.npz") as index:
            if int(index["version"]) != STORE_VERSION:
                return f"version {int(index['version'])}, not {STORE_VERSION}"
            ends = {"rows": index["rows_ptr"][-1], "reads": index["rows_ptr"][-1]}
            if "branches_ptr" in index:
                ends["branches"] = index["branches_ptr"][-1]
            checksums = dict(zip(RAGGED, (int(c) for c in index["crc32"]), strict=False))
        for name, end in ends.items():
            if (path / name).stat().st_size != 4 * int(end):
                return f"{name}: {(path / name).stat().st_size} bytes, not the index's {4 * int(end)}"
            if file_crc32(path / name) != checksums[name]:
                return f"{name}: its checksum differs from the index's"
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHECKSUM_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def build_store(cfg: DictConfig, files: dict, with_branches: bool, path: Path) -> None:
    """One pass over the table: rarefy, count tokens, branch sets; written to a temporary directory renamed
    into place when whole (several processes may build one store at once: the last rename wins)."""
    obs_ids = table_ids(files["table"], "observation")
    tokens, real_tokens, lengths = table_tokens(obs_ids, files["sequences"])
    branches: Branches | None = read_branches(files["tree"], obs_ids) if with_branches else None
    kind = cfg.get("target_type", "auto")
    targets = read_target(files["metadata"], cfg.target, kind) if cfg.target is not None else None
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    seen = without_target = deepest = 0
    used = np.zeros(len(obs_ids), dtype=bool)
    index: dict[str, list] = {"ids": [], "too_shallow": [], "n_tokens": [], "target": []}
    ptr = {"rows": [np.zeros(1, np.int64)], "branches": [np.zeros(1, np.int64)]}
    crc = dict.fromkeys(RAGGED, 0)  # of each raw file as it is written
    try:
        tmp.mkdir(parents=True)
        files_open = contextlib.ExitStack()
        outs = {
            name: files_open.enter_context(open(tmp / name, "wb")) for name in RAGGED[: 3 if branches else 2]
        }
        options = (cfg.rarefy_depth, cfg.seed, cfg.max_asvs)
        job = ChunkJob(files["table"], options, real_tokens, branches, targets, CHUNK_SAMPLES)
        with files_open, tqdm(unit="samples", desc="samples", delay=PROGRESS_AFTER_S) as bar:
            for n_read, chunk_deepest, chunk_without_target, chunk in rarefied_chunks(job):
                bar.update(n_read)
                seen += n_read
                deepest = max(deepest, chunk_deepest)
                without_target += chunk_without_target
                index["ids"] += chunk.ids
                index["too_shallow"] += chunk.too_shallow
                index["n_tokens"].append(chunk.n_tokens)
                index["target"] += [] if targets is None else [targets[sid] for sid in chunk.ids]
                for name, rows in (
                    ("rows", chunk.rows),
                    ("reads", chunk.reads),
                    ("branches", chunk.branches),
                ):
                    if name in outs and rows:
                        raw = np.concatenate(rows).astype(np.int32).tobytes()
                        outs[name].write(raw)
                        crc[name] = zlib.crc32(raw, crc[name])
                        if name in ptr:
                            ptr[name].append(ptr[name][-1][-1] + np.cumsum([len(r) for r in rows]))
                used[chunk.kept_asvs] = True
        if targets is not None and seen == without_target:
            raise UserError(f"data.metadata: no sample of data.table has a value of {cfg.target!r}")
        if not index["ids"]:
            raise no_sample_deep_enough(cfg, deepest)
        arrays = {
            "version": np.array(STORE_VERSION),
            "ids": np.array(index["ids"], dtype=str),
            "too_shallow": np.array(index["too_shallow"], dtype=str),
            "n_tokens": np.concatenate(index["n_tokens"]),
            "target": np.array(index["target"], dtype=np.float64),
            "rows_ptr": np.concatenate(ptr["rows"]),
            "tokens": tokens.numpy(),
            "meta": np.array([without_target, int(used.sum()), cfg.max_asvs]),
            "crc32": np.array([crc[name] for name in RAGGED[: len(outs)]], dtype=np.int64),
            # what reading the files changed, warned at each opening: sequences cut (their count, the
            # longest's bases), branches of the tree without a length (read as 0)
            "changed": np.array(
                [(lengths > ASV_BP).sum(), lengths.max(), 0 if branches is None else branches.missing_lengths]
            ),
        }
        if branches is not None:
            arrays.update(branches_ptr=np.concatenate(ptr["branches"]), branch_lengths=branches.lengths)
        with open(tmp / "index.npz", "wb") as f:
            np.savez(f, **arrays)
        if damage(path) is None:  # another process (a torchrun rank) renamed its whole copy meanwhile
            return
        if path.exists():  # damaged: a rename cannot replace a directory with files in it
            shutil.rmtree(path, ignore_errors=True)
        replace_durably(tmp, path, FIX)
    except OSError as exc:
        if disk_full(exc, path.parent):
            raise no_space(path.parent, "the sample store", FIX) from exc
        if damage(path) is not None:  # not: another process's copy landed between the check and the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("sample store for %d samples written to %s", len(index["ids"]), path)


@dataclass(frozen=True)
class ChunkJob:
    """What rarefying a chunk of the table needs: sent once to each worker process of a parallel build."""

    table: Path
    options: tuple[int, int, int]  # data.rarefy_depth, data.seed, data.max_asvs
    real_tokens: np.ndarray
    branches: Branches | None
    targets: dict[str, float] | None
    chunk_samples: int = CHUNK_SAMPLES

    def rarefy(self, ids: list[str], counts) -> tuple[int, int, int, Chunk]:
        """(samples read, the deepest's reads, samples without a target, the chunk rarefied)."""
        n_read, deepest, without_target = len(ids), int(counts.sum(axis=0).max()), 0
        if self.targets is not None:
            keep = [j for j, sid in enumerate(ids) if sid in self.targets]
            without_target = len(ids) - len(keep)
            ids, counts = [ids[j] for j in keep], counts[:, keep]
        depth, seed, max_asvs = self.options
        cfg = SimpleNamespace(rarefy_depth=depth, seed=seed, max_asvs=max_asvs)
        return (
            n_read,
            deepest,
            without_target,
            rarefy_chunk(ids, counts, cfg, self.real_tokens, self.branches),
        )

    def rarefy_at(self, start: int) -> tuple[int, int, int, Chunk]:
        ((ids, counts),) = table_chunks(self.table, self.chunk_samples, start, start + self.chunk_samples)
        return self.rarefy(ids, counts)


def rarefied_chunks(job: ChunkJob) -> Iterator[tuple[int, int, int, Chunk]]:
    """The table's chunks rarefied, in order: by a worker process per core where the table is HDF5 and has
    `PARALLEL_FROM_CHUNKS` chunks or more (each worker reads its own chunks), else here."""
    n_samples = len(table_ids(job.table)) if h5py.is_hdf5(job.table) else 0
    starts = range(0, n_samples, job.chunk_samples)
    workers = min(core_budget(), len(starts)) if len(starts) >= PARALLEL_FROM_CHUNKS else 1
    main = sys.modules["__main__"]  # a worker imports it: a script read from stdin cannot be
    if getattr(main, "__spec__", None) is None and not Path(getattr(main, "__file__", "") or "-").is_file():
        workers = 1
    if workers < 2:
        yield from (job.rarefy(ids, counts) for ids, counts in table_chunks(job.table, job.chunk_samples))
        return
    # forkserver: a fork of this process would copy its threads' held locks (W&B, monitors, torch)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        yield from pool.map(job.rarefy_at, starts)


def open_store(path: Path, cfg: DictConfig, files: dict) -> Samples:
    """The store's samples, read a sample at a time from `path` (offsets, tokens and targets in memory)."""
    with np.load(path / "index.npz") as index:
        ids, too_shallow = [str(i) for i in index["ids"]], [str(i) for i in index["too_shallow"]]
        target = torch.from_numpy(index["target"]) if len(index["target"]) else None
        rows_ptr, tokens, n_tokens = index["rows_ptr"], torch.from_numpy(index["tokens"]), index["n_tokens"]
        branches = (
            Ragged(index["branches_ptr"], file=str(path / "branches")) if "branches_ptr" in index else None
        )
        lengths = index["branch_lengths"] if "branch_lengths" in index else None
        without_target, n_asvs, max_asvs = (int(x) for x in index["meta"])
        sequences_cut, longest_bp, missing_lengths = (int(x) for x in index["changed"])
    total = without_target + len(ids) + len(too_shallow)
    if without_target:
        warn_without_target(without_target, total, cfg.target, files["metadata"])
    warn_too_shallow(too_shallow, total - without_target, cfg.rarefy_depth)
    warn_sequences_cut(sequences_cut, len(tokens), longest_bp)
    warn_missing_lengths(missing_lengths, files["tree"])
    rarefied = (Ragged(rows_ptr, file=str(path / "rows")), Ragged(rows_ptr, file=str(path / "reads")))
    dataset = SampleDataset(rarefied, max_asvs, n_tokens, target, branches)
    samples = Samples(ids, dataset, tokens, files, without_target, too_shallow, n_asvs, lengths)
    samples.sequences_cut, samples.longest_sequence_bp = sequences_cut, longest_bp
    samples.missing_lengths = missing_lengths
    keep_asvs_by(samples, cfg)
    return samples
