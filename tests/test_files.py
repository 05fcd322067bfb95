"""Atomic, durable writes: the old file or the whole new one, never half, no temporary file left, and a
full disk as one line that names the file."""

import errno
import json
import os
import subprocess
import sys

import pytest

from aamperf.errors import NoSpace, UserError
from aamperf.files import (
    read_json_cache,
    read_json_lines,
    replace_durably,
    update_json_cache,
    write_atomic,
    write_json_atomic,
)


def leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_bytes_text_and_a_writer_each_become_the_whole_file(tmp_path):
    write_atomic(tmp_path / "a.bin", b"\x00\x01")
    write_atomic(tmp_path / "deeper" / "b.txt", "héllo\n")  # the directory is made
    write_atomic(tmp_path / "c.bin", lambda f: f.write(b"written by a writer"))
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "deeper" / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "c.bin").read_bytes() == b"written by a writer"
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "deeper") == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not private


def test_a_failing_writer_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def fails(f):
        f.write(b"half of the new one")
        raise ValueError("the writer broke")

    with pytest.raises(ValueError, match="the writer broke"):  # not a full disk: raised as it is
        write_atomic(path, fails)
    assert path.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_a_full_disk_is_a_user_error_naming_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{}")

    def disk_fills(f):
        f.write(b"{")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError) as caught:
        write_atomic(path, disk_fills, fix="free space there or set hydra.run.dir elsewhere")
    assert isinstance(caught.value, NoSpace) and isinstance(caught.value.__cause__, OSError)
    assert str(caught.value) == (
        f"no space left on the file system of {tmp_path} to write summary.json; "
        "free space there or set hydra.run.dir elsewhere"
    )
    assert path.read_text() == "{}"
    assert leftovers(tmp_path) == []


def test_json_has_null_for_non_finite_floats(tmp_path):
    write_json_atomic(tmp_path / "s.json", {"loss": float("nan"), "curve": [1.5, float("inf")]})
    assert json.loads((tmp_path / "s.json").read_text()) == {"loss": None, "curve": [1.5, None]}


def test_a_directory_replaces_nothing_it_should_not(tmp_path):
    tmp, final = tmp_path / "step_2.tmp", tmp_path / "step_2"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "shard").write_bytes(b"x")
    replace_durably(tmp, final)
    assert (final / "sub" / "shard").read_bytes() == b"x" and not tmp.exists()

    (tmp / "sub").mkdir(parents=True)  # a second copy: `final` has files, it is not replaced
    (tmp / "sub" / "shard").write_bytes(b"y")
    with pytest.raises(OSError):
        replace_durably(tmp, final)
    assert (final / "sub" / "shard").read_bytes() == b"x" and not tmp.exists()


def test_a_damaged_cache_reads_as_empty_and_is_repaired(tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text('{"a": ')
    assert read_json_cache(cache) == {}
    update_json_cache(cache, "b", {"flops": 1})
    assert read_json_cache(cache) == {"b": {"flops": 1}}


def test_a_cache_that_cannot_be_written_is_a_warning_not_the_runs_end(tmp_path, caplog):
    cache = tmp_path / "cache.json"
    cache.mkdir()  # made a directory meanwhile: the rename over it fails (as on a file system made read-only)
    update_json_cache(cache, "a", {"flops": 1})
    assert "not updated" in caplog.text and cache.is_dir() and not list(cache.iterdir())


def test_processes_writing_the_cache_at_once_never_fail_or_leave_a_damaged_file(tmp_path):
    """Two processes (torchrun ranks, a sweep's jobs) write the same cache file 200 times each: every
    writer has its own temporary file, so none fails and the file always parses."""
    cache = tmp_path / "peak_flops.json"
    writer = (
        "import sys; from pathlib import Path; from aamperf.files import update_json_cache\n"
        "for i in range(200): update_json_cache(Path(sys.argv[1]), f'{sys.argv[2]}-{i}', {'flops': i})\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", writer, str(cache), name], stderr=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    entries = json.loads(cache.read_text())
    assert any(k.startswith("a-") for k in entries) and any(k.startswith("b-") for k in entries)
    assert leftovers(tmp_path) == []


def test_json_lines_leave_out_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n\n{"step": 2, "lo')  # a crash mid-line
    assert read_json_lines(path) == [{"step": 1, "loss": 2.5}]
    assert read_json_lines(tmp_path / "absent.jsonl") == []
