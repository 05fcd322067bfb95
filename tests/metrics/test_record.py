import json
import math

import pytest
from conftest import read_summary

from aamperf.metrics import RunRecord, StepMeter


def test_metrics_lines_are_flushed_and_nonfinite_becomes_null(tmp_path):
    record = RunRecord(tmp_path)
    record.log({"step": 1, "loss": 2.5})
    record.log({"step": 2, "loss": math.nan, "parts": [math.inf, 1.0]})
    # Read before close: each line must already be on disk.
    # The file's own lines (not read_metrics, which skips blank ones as the report does).
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": None, "parts": [None, 1.0]}]
    record.close()


def test_summary_is_replaced_whole_and_leaves_no_temp_file(tmp_path):
    record = RunRecord(tmp_path)
    record.write_summary({"status": "running"})
    record.write_summary({"status": "completed", "mfu": 0.25})
    assert read_summary(tmp_path) == {"status": "completed", "mfu": 0.25}
    record.close()  # and the run's lock on the directory goes with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_step_meter_excludes_warmup_and_reports_its_excess():
    meter = StepMeter(skip_steps=2)
    for t in (5.0, 3.0):  # warm-up: 8 s where steady state would take 2 x 1 s
        meter.add(t, data_wait_s=0.5, samples=4, tokens=100)
    for t in (1.0, 1.0, 2.0):
        meter.add(t, data_wait_s=0.25, samples=4, tokens=100)
    s = meter.summary()
    assert s["timed_steps"] == 3
    # the same timed steps, the same statistic: batch / step time == samples/s
    assert s["step_time_s"] == 4.0 / 3 and s["step_time_median_s"] == 1.0 and s["timed_s"] == 4.0
    assert s["samples_per_s"] == 12 / 4.0
    assert s["samples_per_s"] * s["step_time_s"] == pytest.approx(4)
    assert s["tokens_per_s"] == 300 / 4.0
    assert s["data_wait_frac"] == 0.75 / 4.0
    assert s["warmup_excess_s"] == 8.0 - 2 * 1.0  # the warm-up's excess over a typical (median) step
    assert s["time_to_first_step_s"] > 0


def test_step_meter_without_measured_steps_reports_null():
    meter = StepMeter(skip_steps=3)
    meter.add(1.0, 0.0, 4, 10)
    s = meter.summary()
    assert s["samples_per_s"] is None and s["step_time_s"] is None and s["timed_steps"] == 0
