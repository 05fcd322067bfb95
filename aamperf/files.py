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
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from aamperf.config import launch_id
from aamperf.errors import NoSpace, UserError, disk_full, no_space

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


CLAIM = ".running"  # in a run directory while a run holds it: who does (a killed run's is taken over)


class Claim:
    """`directory` held by this launch for as long as it runs: this process, or every process of its
    launch (torchrun's ranks on a node, the tasks of a SLURM step), which share one run directory. Another
    launch is refused with a UserError naming the holder. The claim is a lock on `.running`, held open:
    released when `release()` is called or its process ends, even killed, so a killed run's file is taken
    over. Taken before anything else is written in the directory (aamperf/callbacks.py: before Hydra
    writes .hydra/). A process may claim its own directory again (train() inside the run's callbacks).
    Where the file system has no locks, nothing is held."""

    def __init__(self, directory: Path, fix: str = "set hydra.run.dir elsewhere"):
        self.path, self._fd = Path(directory) / CLAIM, None
        host = socket.gethostname()
        me = {"launch": f"{host} {launch_id()}", "host": host, "pid": os.getpid()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _refuse_when_full(exc, self.path, fix)
            raise
        # one claimer at a time: finding who holds the claim and taking it are one step
        with one_builder(self.path.parent):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by a live process: this launch's, or another's
                holder = json_line(os.pread(fd, 4096, 0).decode(errors="replace")) or {}
                if holder.get("launch") != me["launch"]:
                    os.close(fd)
                    who = f"process {holder['pid']} on {holder['host']}" if "pid" in holder else "a process"
                    raise UserError(
                        f"run directory {self.path.parent} is in use by {who} (its {CLAIM}); give this run "
                        "its own hydra.run.dir"
                    ) from None
                fcntl.flock(fd, fcntl.LOCK_SH)  # the launch's other holders hold it shared too
                self._fd = fd
                return
            except OSError:  # a file system without locks: as one_builder, the run goes on unclaimed
                os.close(fd)
                return
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            except OSError as exc:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                _refuse_when_full(exc, self.path, fix)
                raise
            fcntl.flock(fd, fcntl.LOCK_SH)  # no other claimer in between: they wait for the directory's lock
            self._fd = fd

    def release(self) -> None:
        """Let the directory go; the last holder of its launch removes `.running`."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with one_builder(self.path.parent):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other holder left
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    self.path.unlink()
        except OSError:  # another holder of this launch, or the file already gone: it is theirs to remove
            pass
        finally:
            os.close(fd)


def _refuse_when_full(exc: OSError, path: Path, fix: str) -> None:
    if disk_full(exc, path):
        what = f"the run's claim on its directory ({path.name})"
        raise no_space(path.parent, what, f"free space there or {fix}") from exc


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
