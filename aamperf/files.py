"""Lasting files written atomically and durably: a reader sees the old file or the whole new one, never
half of one, and a full disk is one line that names the file and what to do (`errors.NoSpace`). JSON
caches and JSON-lines records read back whatever a crash left."""

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from aamperf.errors import NoSpace, disk_full, no_space

log = logging.getLogger(__name__)

FREE_SPACE = "free space there"  # what to do on a full disk, when the caller knows nothing better
Writer = Callable[[IO[bytes]], object]  # writes a file's content to the open binary file


def write_atomic(path: Path, data: bytes | str | Writer, fix: str = FREE_SPACE) -> None:
    """Write `data` to `path`: bytes, text (UTF-8), or a function that writes to the open binary file
    (`lambda f: torch.save(obj, f)`, `np.savez`). It goes to a temporary file beside `path`, is fsynced,
    renamed over `path`, and the directory fsynced (the rename survives a power cut too). On any failure
    the temporary file is removed and `path` is as it was; a full disk raises `NoSpace` naming `path`,
    with `fix`. The temporary name is unique to the writer: several processes may write one path at once
    (the last rename wins). The parent directory is created if needed."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # not tempfile.mkstemp: its files are private (0600); this one gets the umask's mode, as a plain open
        name = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        with open(name, "xb") as f:  # by name: a writer's errors name the file; closed before the clean-up
            tmp = name
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException as exc:
        _give_up(exc, tmp, path, fix)


def replace_durably(tmp: Path, final: Path, fix: str = FREE_SPACE) -> None:
    """Rename `tmp`, a file or a directory written by someone else (torch.distributed.checkpoint, h5py),
    to `final` once all of it is on disk, and fsync the directory that holds `final`. On any failure `tmp`
    is removed and `final` is as it was (a directory cannot replace a directory with files in it: that
    fails too); a full disk raises `NoSpace` naming `final`, with `fix`."""
    tmp, final = Path(tmp), Path(final)
    try:
        if tmp.is_dir():
            for root, _, names in os.walk(tmp):
                for name in names:
                    _fsync_file(Path(root) / name)
                fsync_directory(Path(root))  # the entries of each directory
        else:
            _fsync_file(tmp)
        os.replace(tmp, final)
        fsync_directory(final.parent)
    except BaseException as exc:
        _give_up(exc, tmp, final, fix)


@contextlib.contextmanager
def one_builder(directory: Path) -> Iterator[None]:
    """Around the check-and-build of a cache entry in `directory`: one process at a time builds (torchrun
    ranks, a sweep's jobs started together); the others wait, then find the entry whole, where each would
    have built its own copy. An advisory lock on the directory itself (no lock file; released when its
    process ends, even killed). Where none can be taken (a read-only file system, one without locks),
    the block runs unlocked, as it would alone: each entry's write is atomic anyway."""
    held = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        held = os.open(directory, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
    except OSError:
        pass
    try:
        yield
    finally:
        if held is not None:
            os.close(held)  # the lock goes with its descriptor


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's content, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: a non-finite float becomes null (a bad value is never hidden as 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, obj: Any, fix: str = FREE_SPACE) -> None:
    """`obj` as indented JSON (non-finite floats as null), written by `write_atomic`."""
    write_atomic(path, json.dumps(json_safe(obj), indent=2) + "\n", fix)


def read_json_cache(path: Path) -> dict[str, Any]:
    """A JSON object kept between runs, or {} when it is absent or damaged (the next write repairs it)."""
    try:
        cache = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def update_json_cache(path: Path, key: str, entry: Any) -> None:
    """Add `entry` under `key`. Several processes (torchrun ranks, sweeps) may write at once: at worst one
    entry is lost, never the file. A full disk, or a file that cannot be written, is a warning: a cache entry
    is measured again next time."""
    try:
        write_json_atomic(path, {**read_json_cache(path), key: entry})
    except NoSpace:
        log.warning("%s not updated: no space left on its file system", path)
    except OSError as exc:  # a cache is an aid, not the run's: made read-only or removed meanwhile
        log.warning("%s not updated: %s", path, exc.strerror or exc)


def json_line(line: str) -> dict[str, Any] | None:
    """A JSON-lines line as its object; None for a line cut short by a crash or a full disk (appended
    files such as metrics.jsonl are not written atomically)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file in order (none without the file), damaged lines left out."""
    if not Path(path).exists():
        return []
    return [row for line in Path(path).read_text().splitlines() if (row := json_line(line)) is not None]


def fsync_directory(directory: Path) -> None:
    """Make the entries of `directory` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _give_up(exc: BaseException, tmp: Path | None, path: Path, fix: str) -> NoReturn:
    # asked before the partial file goes: it may be what filled the disk
    full = isinstance(exc, Exception) and disk_full(exc, path)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    if full:
        raise no_space(path.parent, path.name, fix) from exc
    raise exc
