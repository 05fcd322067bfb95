"""Alerts: thresholds with warn and critical levels, raised once per crossing into train.log,
summary.json and W&B (read back from the offline run), and a critical one stopping the run when asked."""

import pytest
from conftest import read_summary, read_wandb
from omegaconf import OmegaConf

from aamperf.alerts import Alerts
from aamperf.checks import check_config
from aamperf.errors import RunAborted, UserError
from aamperf.run import train


def alerts(**levels):
    cfg = OmegaConf.create(
        {
            "alerts": {
                "samples_per_s": levels.get("samples_per_s", {"warn": 100.0, "critical": 50.0}),
                "val_loss": levels.get("val_loss", {"warn": 2.0, "critical": 4.0}),
                "gpu_util_percent": {"warn": None, "critical": None},
                "stop_on_critical": levels.get("stop", False),
            },
            "memory": {"warn_fraction": 0.9, "max_fraction": 0.97},
        }
    )
    return Alerts(cfg)


def test_an_alert_is_raised_once_per_crossing_and_again_when_it_worsens_or_returns():
    a = alerts()
    a.check(10, {"samples_per_s": 80.0})  # below the warn floor
    a.check(20, {"samples_per_s": 70.0})  # still: said already
    a.check(30, {"samples_per_s": 40.0})  # worse: critical
    a.check(40, {"samples_per_s": 120.0})  # back above: re-armed
    a.check(50, {"samples_per_s": 90.0, "val_loss": 5.0, "memory_fraction": 0.95, "gpu_util_percent": None})
    raised = [(x["step"], x["metric"], x["level"]) for x in a.raised]
    assert raised == [
        (10, "samples_per_s", "warn"),
        (30, "samples_per_s", "critical"),
        (50, "samples_per_s", "warn"),
        (50, "val_loss", "critical"),  # a ceiling: above is bad
        (50, "memory_fraction", "warn"),  # memory's levels: memory.warn_fraction / max_fraction
    ]
    assert a.raised[1]["message"] == "samples_per_s 40 below its critical level 50 (alerts.samples_per_s)"


def test_a_critical_alert_stops_only_when_asked():
    assert alerts().check(1, {"val_loss": 9.0}) is None
    stop = alerts(stop=True).check(1, {"val_loss": 9.0})
    assert stop.startswith("critical alert: val_loss 9 above its critical level 4")


def test_levels_on_the_wrong_side_are_refused(make_cfg):
    with pytest.raises(
        UserError, match=r"alerts.samples_per_s.critical=200.0 must be below alerts.samples_per_s.warn"
    ):
        check_config(make_cfg("alerts.samples_per_s.warn=100", "alerts.samples_per_s.critical=200"))


def test_a_run_raises_its_alerts_into_its_log_summary_and_wandb(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no W&B key: offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = make_cfg(
        "trainer.max_steps=6",
        "logger=wandb",
        "alerts.samples_per_s.warn=1000000",  # no CPU reaches it: a warning at the first timed line
        "alerts.val_loss.critical=0.001",  # nor this: a critical alert at the first validation
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"  # alerts.stop_on_critical=false: the run goes on
    metrics = {(a["metric"], a["level"]) for a in summary["alerts"]}
    assert metrics == {("samples_per_s", "warn"), ("val_loss", "critical")}
    sent = [r["alert"] for r in read_wandb(tmp_path / "wandb" / "latest-run") if r["type"] == "alert"]
    assert {(x["title"], x["level"]) for x in sent} == {
        ("warn: samples_per_s", "WARN"),
        ("critical: val_loss", "ERROR"),
    }


def test_a_critical_alert_can_stop_the_run_with_a_checkpoint(make_cfg, tmp_path, caplog):
    cfg = make_cfg("trainer.max_steps=8", "alerts.val_loss.critical=0.001", "alerts.stop_on_critical=true")
    with pytest.raises(RunAborted, match="critical alert: val_loss .* above its critical level 0.001"):
        train(cfg, tmp_path)
    summary = read_summary(tmp_path)
    assert summary["status"] == "aborted" and summary["steps"] == 2  # the first validation (val_every=2)
    assert summary["alerts"][0]["metric"] == "val_loss"
    assert (tmp_path / "checkpoints" / "step_00000002.pt").exists()
    assert "alert at step 2: val_loss" in caplog.text  # aamperf.alerts' logger: train.log in a run
