"""metrics.profile_steps: torch.profiler over steady-state steps, left out of the timing."""

import json

from aamperf.run import train


def test_profiled_steps_give_a_trace_and_top_ops_and_stay_out_of_timing(make_cfg, tmp_path):
    summary = train(make_cfg("trainer.max_steps=4", "metrics.profile_steps=2"), tmp_path)
    profile = summary["profile"]
    assert profile["profiled_steps"] == 2 and profile["comm_time_frac"] == 0  # one process: no collectives
    assert profile["top_ops"][0]["self_cpu_s"] > 0 and profile["top_ops"][0]["op"].startswith("aten::")
    trace = json.loads((tmp_path / "profile_trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert summary["timed_steps"] == 4 - 1 - 2  # skip_steps=1 warm-up, 2 profiled, 1 timed
