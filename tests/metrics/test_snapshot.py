"""metrics.memory_snapshot: the profiler's memory timeline of a CPU run, named in summary.json."""

import json

import pytest
import torch
from hydra.utils import instantiate

from aamperf.run import train


def test_a_cpu_run_writes_its_memory_timeline_and_names_it_in_the_summary(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=5", "metrics.profile_steps=1", "metrics.memory_snapshot=true")
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    snapshot = summary["profile"]["memory_snapshot"]
    # after the warm-up step and the profiled one: steps 3 and 4, left out of the timing with them
    assert snapshot["file"] == "memory_timeline.json" and snapshot["steps"] == [3, 4]
    assert summary["profile"]["profiled_steps"] == 1 and summary["timed_steps"] == 5 - 1 - 1 - 2
    times, sizes = json.loads((tmp_path / snapshot["file"]).read_text())
    assert len(times) == len(sizes) == snapshot["events"] > 0
    columns = snapshot["columns"]
    assert all(len(s) == len(columns) for s in sizes) and "activation" in columns
    assert snapshot["peak_bytes"] == max(sum(s) for s in sizes)
    # the model's parameters at least: aam_tiny's fp32 weights, and its activations while training
    params = sum(p.numel() * 4 for p in instantiate(cfg.model).parameters())
    peak = sizes[max(range(len(sizes)), key=lambda i: sum(sizes[i]))]
    assert peak[columns.index("parameter")] >= params
    assert max(s[columns.index("activation")] for s in sizes) > 0


def test_a_run_too_short_for_the_snapshot_says_so(make_cfg, tmp_path, caplog):
    summary = train(make_cfg("trainer.max_steps=1", "metrics.memory_snapshot=true"), tmp_path)
    assert summary["profile"]["memory_snapshot"]["file"] is None
    assert "trainer.max_steps=1 ends before step 2" in summary["profile"]["memory_snapshot"]["reason"]
    assert not list(tmp_path.glob("memory_timeline*"))
    assert "no snapshot" in caplog.text


@pytest.mark.parametrize("option", ["metrics.memory_snapshot=true", "metrics.profile_steps=2"])
def test_a_run_that_fails_inside_the_recorded_steps_leaves_no_profiler_running(make_cfg, tmp_path, option):
    # left on, the profiler would go on recording (and slowing) the next job of this process
    cfg = make_cfg("trainer.max_steps=5", option, "loss._target_=plugin_model.BrokenLoss", "+loss.at=3")
    with pytest.raises(RuntimeError, match="BrokenLoss: step 3"):
        train(cfg, tmp_path)
    assert not torch.autograd.profiler._is_profiler_enabled


def test_the_peak_of_a_cuda_history_is_explained_by_where_its_blocks_were_allocated():
    """peak_sources replays the allocator's events (the CUDA run's summary: tests/gpu/test_cuda_runs.py):
    the most held at once, counted from what was allocated before, and the live blocks then by source."""
    from aamperf.metrics.snapshot import peak_sources

    def frames(*where):
        return [{"filename": f, "line": line, "name": name} for f, line, name in where]

    layers = frames(("/t/torch/functional.py", 10, "linear"), ("/r/aamperf/model/layers.py", 95, "forward"))
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": layers},
        {"action": "alloc", "addr": 2, "size": 50, "frames": layers},
        {"action": "free_completed", "addr": 9, "size": 30},  # a block from before the recording
        {"action": "alloc", "addr": 3, "size": 70, "frames": []},  # backward's thread: no Python frame
        {"action": "free_requested", "addr": 1, "size": 100},  # not free yet
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": frames(("/x/site/lib.py", 3, "f"))},
    ]
    found = peak_sources(events, start_bytes=1000, top=1)
    # 1000 + 100 + 50 - 30 + 70 = 1190 after the 4th event; 1190 - 100 + 60 = 1150 at the end
    assert found["peak_bytes"] == 1190 and found["held_from_before_bytes"] == 970
    assert found["sources"] == [{"where": "model/layers.py:95 forward", "bytes": 150, "blocks": 2}]
    assert found["other_sources_bytes"] == 70
    assert peak_sources([], start_bytes=5)["peak_bytes"] == 5
    assert peak_sources(events, 0, top=3)["sources"][1]["where"] == "(no Python frame: backward's thread)"
