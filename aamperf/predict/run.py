"""`python -m aamperf.predict`'s work (`predict`): a completed run's model applied to samples, at the
inference level its config composes, the files written (aamperf/predict/__init__.py lists them)."""

import logging
import shutil
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from aamperf.allocator import PREDICT, check_allocator
from aamperf.batch_size import find_forward_batch
from aamperf.checks import cache_file_problem, check_values
from aamperf.data.categorical import saved_vocabularies
from aamperf.data.collate import Collate
from aamperf.data.loaders import Draws
from aamperf.data.samples import read_samples
from aamperf.data.tables import resolve_files, table_ids
from aamperf.device import resolve_device, to_device
from aamperf.distributed import World, close_world, join_world, torchrun_env
from aamperf.errors import UserError
from aamperf.files import write_atomic, write_json_atomic
from aamperf.interrupts import stop_if_signalled
from aamperf.metrics.host import cpu_description
from aamperf.metrics.monitor import peak_rss, reset_peak_rss
from aamperf.model import AAM
from aamperf.phases.aam_ops import set_full_length, unmask_for
from aamperf.phases.system import allocator_record, given, malloc_record, thread_record, threads_for_quota
from aamperf.predict.bench import latencies
from aamperf.predict.categorical import attach_categories, category_record, check_metadata
from aamperf.predict.export import export_model
from aamperf.predict.levels import apply_levels, forward, quality
from aamperf.predict.masks import hidden_bases, run_masks, sequence_keys
from aamperf.predict.outputs import write_predictions
from aamperf.predict.target import SavedTarget, observed_values, read_saved_target, sample_units
from aamperf.tokens import MASK
from aamperf.weights import MODEL_FILE, OWN_MODELS, build_model, load_model, read_model_file

log = logging.getLogger(__name__)


def data_config(run_data: dict[str, Any], new: DictConfig, target: SavedTarget | None) -> DictConfig:
    """The run's data config (its samples), or a new table in its place; rarefaction, the ASV cut and
    data.seed stay the run's, so the model reads samples as it was trained on them. The target column is
    read as the model's target: numbers for a regression, names for a classification."""
    cfg = OmegaConf.create(run_data)
    if new.table is None:
        if new.metadata is not None or new.sequences is not None:
            raise UserError(
                "data.metadata and data.sequences go with a new data.table; give data.table=<t.biom>"
            )
    else:
        cfg.source, cfg.table, cfg.tree, cfg.unifrac = "biom", new.table, None, None
        cfg.metadata, cfg.sequences = new.metadata, new.sequences
        cfg.target = (new.target or cfg.get("target")) if new.metadata is not None else None
    if new.get("asv_sampling") is not None:
        cfg.asv_sampling = new.asv_sampling
    if cfg.get("target") is not None and target is not None:
        cfg.target_type = target.spec.kind
    return cfg


def saved_target(payload: dict[str, Any]) -> Any:
    """The model `_target_` a model file's config names, or None."""
    config = payload.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    return model.get("_target_") if isinstance(model, dict) else None


def predict(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Apply the run's model, at the inference level `cfg` composes, to the samples; write the files;
    return the summary (also written). A table of more than `chunk_samples` samples is read, rarefied
    and predicted a chunk at a time. Under torchrun each rank predicts whole batches of each chunk and
    writes its share; the first rank merges the shares into the files one process writes.
    bench.enabled=true: the latencies of the level instead of the files (aamperf/predict/bench.py)."""
    start = time.perf_counter()
    check_values(cfg, {"run": "give the training run to predict with: run=<its directory> (outputs/runs/..)"})
    problems = cache_file_problem(str(cfg.probe.cache), "probe.cache", "the device probe's answers")
    for problem in problems + check_allocator(cfg.allocator, PREDICT):
        raise UserError(problem)
    device = resolve_device(cfg.device)
    threads = thread_record(threads_for_quota(given()[1]))  # a cgroup's CPU quota, as a run takes it
    allocator = allocator_record(cfg.allocator, PREDICT)  # preloaded by __main__ where it could be
    malloc = malloc_record(cfg.reuse_freed_memory)  # every job of a sweep alike, the first included
    if cfg.timeout_s <= 0:
        raise UserError(
            f"timeout_s={cfg.timeout_s} must be > 0 (seconds a collective may wait under torchrun)"
        )
    world = join_world("auto", cfg.timeout_s, device) if torchrun_env() else World()
    completed = False
    try:
        auto_batch = cfg.batch_size == "auto"
        if not (auto_batch or isinstance(cfg.batch_size, int) and cfg.batch_size >= 1):
            raise UserError(f"batch_size={cfg.batch_size}: give a number >= 1, or auto")
        if cfg.quality_samples < 0 or cfg.chunk_samples < 0:
            raise UserError("quality_samples and chunk_samples must be >= 0")
        if cfg.bench.enabled and world.world_size > 1:
            raise UserError("bench.enabled=true measures one process: run it without torchrun")
        payload = read_model_file(Path(cfg.run))
        target = saved_target(payload)
        # the levels, files and quality check read AAM's outputs
        if not (isinstance(target, str) and target in OWN_MODELS):
            raise UserError(
                f"run={cfg.run} trained {target} (model._target_), not AAM: predict serves AAM models (and "
                "builds no other from a file, which would run its code); load it with "
                f"aamperf.weights.load_model(run_dir, trust=[{target!r}]) and call it yourself"
            )
        model = build_model(payload, Path(cfg.run) / MODEL_FILE, device)
        assert isinstance(model, AAM)
        target = read_saved_target(payload, Path(cfg.run) / MODEL_FILE)
        vocabularies = saved_vocabularies(payload.get("categorical"), Path(cfg.run) / MODEL_FILE)
        data_cfg = data_config(payload["config"]["data"], cfg.data, target)
        masks = run_masks(payload["config"], cfg.mask)
        check_passes(cfg.passes, data_cfg.get("asv_sampling", "abundance"), masks)
        check_metadata(vocabularies, data_cfg, cfg.run)
        if vocabularies and cfg.export:
            raise UserError(
                f"export=true serves tokens and counts; run={cfg.run} also reads categorical metadata "
                f"({', '.join(vocabularies)}), which the exported program does not take: set export=false"
            )
        # every read of samples carries their categories, mapped with the saved vocabularies
        read_chunk = partial(read_categorized_samples, vocabularies=vocabularies)
        chunks = sample_chunks(data_cfg, cfg.chunk_samples, 1 if auto_batch else cfg.batch_size)
        samples = read_chunk(data_cfg, keep_unlabelled=True, sample_ids=chunks[0])
        warm = 32 if auto_batch else cfg.batch_size  # compile's warm-up batch, the export's example
        first_batch = to_device(collate_range(samples, range(min(len(samples.ids), warm))), device)
        # the serving program from the trained model as it is, before any level changes it
        exported = export_model(model, first_batch, out_dir) if cfg.export and world.is_main else None
        model_cfg = OmegaConf.create(payload["config"]["model"])
        total = len(samples.ids) if chunks == [None] else sum(len(chunk) for chunk in chunks)
        calls = -(-total // (warm if auto_batch else cfg.batch_size))  # forward passes: compile=auto's stake
        set_full_length(model, samples.tokens)  # the first chunk's ASVs: aam_ops.unmask_full_length's check
        autocast, phases = apply_levels(model, cfg, device, model_cfg, first_batch, calls, world)
        found = None
        if auto_batch:  # measured with the level applied: what it keeps in memory is what counts
            run = partial(forward, model, autocast=autocast)
            found = find_forward_batch(run, samples.dataset, collate_of(samples), device, cfg.auto_batch)
            cfg.batch_size = found["batch_size"]
            rounded = sample_chunks(data_cfg, cfg.chunk_samples, cfg.batch_size)  # whole batches a chunk
            if rounded != chunks:
                chunks = rounded
                samples = read_chunk(data_cfg, keep_unlabelled=True, sample_ids=chunks[0])
        summary = {
            "status": "completed",
            "batch_finder": found,
            "run": str(cfg.run),
            "inference": cfg.inference,
            "phases": phases,
            "threads": threads,
            "allocator": allocator,
            "malloc": malloc,
            "device": str(device),
            "cpu": cpu_description() if device.type == "cpu" else None,
            "world_size": world.world_size,
            "chunks": len(chunks),
            "batch_size": cfg.batch_size,
            "target": None if target is None else target.describe(),  # column, transform or classes
            "masks": masks,  # the bases each pass hid (the run's training's), or None: whole sequences
            "passes": 1 if cfg.bench.enabled else cfg.passes,
            "export": exported,
        }
        reset_peak_rss()
        if cfg.bench.enabled:  # the level's latencies, and its quality on the first samples
            n = len(samples.ids)
            record_chunk_masks(
                phases["aam_ops"], cfg.aam_ops, [unmask_for(model, cfg.aam_ops, samples.tokens)]
            )
            sizes = {
                size: to_device(collate_range(samples, range(min(size, n))), device)
                for size in cfg.bench.batch_sizes
            }
            summary["bench"] = latencies(model, autocast, sizes, cfg)
            first = range(min(n, cfg.quality_samples))
            mine = apply_model(model, autocast, samples, first, cfg, device, False, passes=1, masks=masks)
            summary.update(n_samples=n, quality=check_quality(mine, samples, cfg, device, target, masks))
        else:
            mine, read = predict_chunks(
                model, autocast, data_cfg, chunks, samples, cfg, device, world, read_chunk, masks
            )
            summary.update(n_samples=len(read["ids"]), too_shallow=read["too_shallow"])
            record_chunk_masks(phases["aam_ops"], cfg.aam_ops, read["unmasked"])
            if world.is_main:  # the first samples through the fp32 eager model too
                level = (model, autocast)
                summary["quality"] = check_quality(mine, samples, cfg, device, target, masks, level)
            parts = gather_shares(out_dir, mine, world)
            if not world.is_main:
                completed = True
                return {}
            metadata = resolve_files(data_cfg).get("metadata")
            observed = observed_values(metadata, data_cfg.get("target"), read["ids"], target)
            units, groups = sample_units(target, metadata, read["ids"], str(cfg.run))
            if groups is not None:  # zscore_category's: the samples of categories training lacks
                summary["target_groups"] = groups
            summary["categorical"] = category_record(vocabularies, metadata, read["ids"])
            stop_if_signalled()  # a stop signal that code on the way swallowed: no file written after it
            summary.update(
                write_predictions(out_dir, read, parts, cfg.pairwise, target, observed, cfg.passes, units)
            )
            if exported is not None:
                summary["files"][exported["file"]] = (
                    "the model as a torch.export program: torch.export.load(path).module()"
                )
        summary.update(peak_rss_bytes=peak_rss(), duration_s=time.perf_counter() - start)  # the first rank's
        write_json_atomic(out_dir / "summary.json", summary)
        completed = True
        return summary
    finally:  # after a failure no barrier: a peer may never reach it
        close_world(completed=completed)


def check_passes(passes: int, asv_sampling: str, masks: dict[str, Any] | None) -> None:
    """`passes` > 1 reads each sample anew each pass: only where its ASVs are drawn (random) or its bases
    hidden (`run_masks`)."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise UserError(f"passes={passes} must be an integer >= 1")
    if passes > 1 and asv_sampling != "random" and masks is None:
        raise UserError(
            f"passes={passes} reads each sample anew each pass, which neither data.asv_sampling="
            f"{asv_sampling} nor the masks do (the run hid no bases, or mask=none): the same input every "
            "time; set data.asv_sampling=random, or passes=1"
        )


def sample_chunks(data_cfg: DictConfig, chunk_samples: int, batch_size: int) -> list[list[str] | None]:
    """The table's sample ids in chunks of `chunk_samples` (rounded up to whole batches: the batches are
    those of the whole table), each read (HDF5: only its samples' counts), rarefied and predicted in
    turn; [None]: the whole table at once (it has no more samples, or chunk_samples=0). Each sample is
    rarefied on its own (data.seed and its id): the draws are the whole table's."""
    if chunk_samples == 0:
        return [None]
    ids = table_ids(resolve_files(data_cfg)["table"])
    size = -(-chunk_samples // batch_size) * batch_size
    if len(ids) <= size:
        return [None]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def batch_share(n: int, batch_size: int, world: World) -> range:
    """This rank's whole batches of n samples: the batches are those of one process (the same padding)."""
    batches = -(-n // batch_size)
    first, last = (batches * r // world.world_size * batch_size for r in (world.rank, world.rank + 1))
    return range(min(first, n), min(last, n))


def predict_chunks(
    model, autocast, data_cfg, chunks, first, cfg: DictConfig, device, world: World, read_chunk=read_samples,
    masks: dict[str, Any] | None = None,
):  # fmt: skip
    """Every chunk through the model, this rank's batches of each: (its share, with each row's place in
    the output; what was read: every sample's id, the samples too shallow). `read_chunk`: how a chunk is
    read (with its categories where the model is conditioned); `masks`: the bases hidden (`run_masks`)."""
    shares: list[dict] = []
    read: dict[str, list] = {"ids": [], "too_shallow": [], "unmasked": []}
    for k, chunk in enumerate(chunks):
        samples = first if k == 0 else read_chunk(data_cfg, keep_unlabelled=True, sample_ids=chunk)
        read["unmasked"].append(unmask_for(model, cfg.aam_ops, samples.tokens))  # this chunk's ASVs decide
        share = batch_share(len(samples.ids), cfg.batch_size, world)
        part = apply_model(
            model, autocast, samples, share, cfg, device, cfg.progress and world.is_main, masks=masks
        )
        part["rows"] = torch.arange(share.start, share.stop) + len(read["ids"])
        shares.append(part)
        read["ids"] += samples.ids
        read["too_shallow"] += samples.too_shallow
        del samples  # the chunk's table and tokens go before the next is read
    if read["too_shallow"] and world.is_main:
        log.warning(
            "%d samples have fewer reads than the run's data.rarefy_depth and get no prediction: %s",
            len(read["too_shallow"]),
            ", ".join(read["too_shallow"][:10]),
        )
    mine = {
        key: concat([part[key] for part in shares]) for key in ("embedding", "predicted", "latencies", "rows")
    }
    return mine, read


def record_chunk_masks(record: dict, cfg: DictConfig, unmasked: list[bool]) -> None:
    """aam_ops.unmask_full_length decided per chunk of samples (each has its own ASVs): the aam_ops record
    says over all of them whether the ASV encoder kept its masks, and in how many chunks."""
    if not cfg.unmask_full_length or "asv_masks" not in record:
        return
    kept = unmasked.count(False)
    record["asv_masks"] = kept > 0
    record.pop("asv_masks_kept", None)
    if kept:
        where = (
            "the samples have" if len(unmasked) == 1 else f"{kept} of {len(unmasked)} chunks of samples have"
        )
        record["asv_masks_kept"] = f"{where} ASVs with PAD inside (under 150 bp, or ambiguous bases)"


def read_categorized_samples(data_cfg: DictConfig, vocabularies=None, **options: Any):
    """read_samples, each sample's categories mapped with the model's vocabularies (`attach_categories`)."""
    samples = read_samples(data_cfg, **options)
    attach_categories(samples, vocabularies)
    return samples


def concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the non-empty ones (a rank may have no batch of a chunk)."""
    kept = [t for t in tensors if t.numel()]
    return torch.cat(kept) if kept else tensors[0]


def check_quality(
    mine: dict, samples, cfg: DictConfig, device, target: SavedTarget | None, masks=None, level_model=None
) -> dict | None:
    """The level against the fp32 eager model on the first `quality_samples` samples (None: none asked),
    both on the same input (`masks`). Over `passes`, their first draw, through the level's (model, autocast)
    `level_model` again."""
    rows = range(min(cfg.quality_samples, first_rows(mine), len(samples.ids)))
    if not len(rows):
        return None
    reference, _ = load_model(Path(cfg.run), device)
    plain = apply_model(reference, nullcontext, samples, rows, cfg, device, False, passes=1, masks=masks)
    level = {key: mine[key][: len(rows)] for key in ("embedding", "predicted")}
    if level_model is not None and cfg.passes > 1:  # means over draws: the level's first draw compared
        level = apply_model(*level_model, samples, rows, cfg, device, False, passes=1, masks=masks)
    ids = samples.ids[: len(rows)]  # zscore_category: their own units (predictions warn of the rest)
    units, _ = sample_units(target, samples.files.get("metadata"), ids, str(cfg.run), warn=False)
    return quality(plain, level, target, units)


def first_rows(mine: dict) -> int:
    """How many of this rank's outputs are the table's first samples, in order: all of one process's; of a
    rank's share (its `rows`), those up to its first gap (rank 0's batches of the first chunk)."""
    if "rows" not in mine:
        return len(mine["embedding"])
    rows = mine["rows"]
    return int((rows == torch.arange(len(rows))).cumprod(0).sum())


def collate_range(samples, rows: range) -> dict[str, Any]:
    """These samples as one batch, padded to the longest of them."""
    return collate_of(samples)([samples.dataset[i] for i in rows])


def collate_of(samples) -> Collate:
    """Prediction's batches: each as wide as its longest sample, no UniFrac to slice."""
    return Collate(samples.tokens, None, pad_to=None)


def apply_model(
    model, autocast, samples, share: range, cfg: DictConfig, device, show: bool, passes: int | None = None,
    masks: dict[str, Any] | None = None,
) -> dict:  # fmt: skip
    """These samples through the model: their embeddings, target outputs in the model's units (empty
    without a target head) and each batch's seconds. `passes` (default cfg.passes) > 1: each sample that
    many times, draws 0, 1, ... of its ASVs (data.asv_sampling=random) and of the bases `masks` hides
    (`run_masks`: pass k hides those of step k): the mean embedding, and the target outputs of every pass
    [n, passes, outputs] (`target_table` averages them in the target's units)."""
    passes = cfg.passes if passes is None else passes
    sequences = None if masks is None else sequence_keys(samples.tokens)
    embeddings, predicted, latencies = [], [], []
    for draw in range(passes):
        keys = [(draw, k) for k in range(len(share))]
        loader = DataLoader(
            Draws(samples.dataset, list(share)), batch_size=cfg.batch_size, sampler=keys,
            collate_fn=collate_of(samples),
        )  # fmt: skip
        mine = [torch.zeros(0, 0)], [torch.zeros(0)]
        bar = tqdm(loader, desc="predict" if passes == 1 else f"predict, pass {draw + 1} of {passes}",
                   unit="batch", disable=not show, dynamic_ncols=True)  # fmt: skip
        for batch in bar:
            begin = time.perf_counter()
            if masks is not None:
                hidden = hidden_bases(batch, sequences, draw, masks)
                batch["tokens"] = batch["tokens"].masked_fill(hidden, MASK)
            out = forward(model, to_device(batch, device), autocast)
            mine[0].append(out["sample_embedding"].float().cpu())  # host sync: the batch is done
            if "target" in out:
                mine[1].append(out["target"].float().cpu().squeeze(1))
            latencies.append(time.perf_counter() - begin)
        embeddings.append(torch.cat(mine[0][1:]) if len(mine[0]) > 1 else torch.zeros(0, 0))
        predicted.append(torch.cat(mine[1]))
    return {
        "embedding": torch.stack(embeddings).mean(0),
        "predicted": predicted[0] if passes == 1 else torch.stack(predicted, dim=1),
        "latencies": torch.tensor(latencies, dtype=torch.float64),
    }


def gather_shares(
    out_dir: Path, mine: dict[str, torch.Tensor], world: World
) -> list[dict[str, torch.Tensor]]:
    """Every rank's share, in rank order (= the input order), on the first rank: each rank writes its
    share to `<out_dir>/shares/`, the first reads them all after a barrier and removes them."""
    if world.world_size == 1:
        return [mine]
    shares = out_dir / "shares"
    path = shares / f"rank{world.rank}.pt"
    write_atomic(path, lambda f: torch.save(mine, f))
    torch.distributed.barrier()
    if not world.is_main:
        return []
    parts = [torch.load(shares / f"rank{r}.pt", weights_only=True) for r in range(world.world_size)]
    shutil.rmtree(shares)
    return [part for part in parts if part["embedding"].numel()]
