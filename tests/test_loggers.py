"""Logger sinks: TensorBoard read back, W&B falling back to offline, a broken sink never stops a run."""

import os
import socket

import pytest
from conftest import read_metrics, read_summary, read_wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from aamperf.errors import UserError
from aamperf.loggers import metric_name, sweep_group
from aamperf.metrics import RunRecord
from aamperf.run import train


def test_metric_names_fall_into_sections():
    names = {
        k: metric_name(k)
        for k in (
            "loss",
            "loss_unifrac",
            "val_loss",
            "val_loss_target",
            "samples_per_s",
            "rss_bytes",
            "cpu_percent",
        )
    }
    assert names == {
        "loss": "train/loss",
        "loss_unifrac": "train/loss_unifrac",
        "val_loss": "val/loss",
        "val_loss_target": "val/loss_target",
        "samples_per_s": "perf/samples_per_s",
        "rss_bytes": "mem/rss_bytes",
        "cpu_percent": "sys/cpu_percent",
    }
    assert sweep_group("outputs/multirun/2026-11-22/04-50-00") == "2026-11-22_04-50-00"
    assert sweep_group("/data/my_study") == "my_study"


def test_tensorboard_events_hold_the_logged_scalars(make_cfg, tmp_path):
    summary = train(make_cfg("logger=tensorboard"), tmp_path)
    assert summary["status"] == "completed" and summary["logger"][0]["backend"] == "tensorboard"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = read_metrics(tmp_path)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"perf/samples_per_s", "mem/rss_bytes", "val/loss", "summary/samples_per_s"} <= set(
        events.Tags()["scalars"]
    )
    assert events.Scalars("summary/samples_per_s")[-1].value == pytest.approx(
        summary["samples_per_s"], rel=1e-6
    )


def test_wandb_with_an_invalid_key_continues_offline(make_cfg, tmp_path, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as server:  # a server this machine reaches
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("WANDB_API_KEY", "not-a-key")  # W&B refuses it at init
        summary = train(make_cfg("logger=wandb", "logger.mode=online"), tmp_path)
    assert summary["status"] == "completed"
    info = summary["logger"][0]
    assert info["mode"] == "offline" and "API key" in info["fallback"]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # kept for `wandb sync`


def test_wandb_without_a_way_to_its_server_goes_offline_at_once(make_cfg, tmp_path, monkeypatch):
    """A compute node without internet but with a key: offline at once, not after wandb.init's 30 s."""
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.aamperf-test.invalid")  # .invalid: never a host
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 2 + "01234567")  # a key of W&B's form
    summary = train(make_cfg("logger=wandb", "logger.mode=online"), tmp_path)
    info = summary["logger"][0]
    assert info["mode"] == "offline"
    assert info["fallback"].startswith("cannot reach the W&B server at api.aamperf-test.invalid:443 (")
    assert summary["time_to_first_step_s"] < 25  # wandb.init alone waits 30 s
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # kept for `wandb sync`


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_user_logged_in_to_their_own_wandb_server_goes_online_there(launch, tmp_path):
    """`wandb login --host`: the server in wandb's settings file, the key in ~/.netrc under that host.
    No network here: online is tried at that server (and falls back offline, saying so)."""
    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True)
    (home / ".config" / "wandb" / "settings").write_text(
        "[default]\nbase_url = https://wandb.aamperf-test.invalid\n"
    )
    (home / ".netrc").write_text(
        "machine wandb.aamperf-test.invalid\n  login user\n  password " + "ab" * 20 + "\n"
    )
    (home / ".netrc").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))} | {"HOME": str(home)}
    proc, run_dir = launch("logger=wandb", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = read_summary(run_dir)["logger"][0]
    assert info["mode"] == "offline"
    assert info["fallback"].startswith("cannot reach the W&B server at wandb.aamperf-test.invalid:443 (")


def test_the_wandb_server_is_reached_through_the_https_proxy_where_one_is_set(monkeypatch):
    from aamperf import loggers

    monkeypatch.setattr(loggers, "_unreachable", {})
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.aamperf-test.invalid")
    for name in ("no_proxy", "NO_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as proxy:  # the only way out of this network
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        assert loggers.wandb_unreachable() is None  # W&B goes through it: wandb.init decides
        closed = proxy.getsockname()[1]
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed}")
    monkeypatch.setattr(loggers, "_unreachable", {})
    assert loggers.wandb_unreachable().startswith(f"cannot reach the W&B server at 127.0.0.1:{closed} (")
    monkeypatch.setenv("NO_PROXY", "api.aamperf-test.invalid")  # not through the proxy: the host itself
    assert "api.aamperf-test.invalid:443" in loggers.wandb_unreachable()


class BrokenSink:
    info = {"backend": "broken"}

    def log(self, row):
        raise ConnectionError("server went away")

    def summary(self, summary):
        pass

    def close(self, failed):
        pass


def test_a_failing_sink_is_dropped_and_the_files_stay_complete(tmp_path):
    record = RunRecord(tmp_path, sinks=[BrokenSink()])
    with pytest.warns(UserWarning, match="BrokenSink switched off: log failed: server went away"):
        record.log({"step": 1, "loss": 2.0})
    record.log({"step": 2, "loss": 1.5})
    record.write_summary({"status": "completed"})
    record.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert record.sinks == []


def test_a_failed_job_still_finishes_its_wandb_run(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no key: offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(UserError):
        train(make_cfg("logger=wandb", "trainer.batch_size=1"), tmp_path)
    [state] = read_wandb(tmp_path / "wandb" / "latest-run", "--summary")
    assert state["exit_code"] == 1 and state["summary"]["status"] == "failed"
    assert "trainer.batch_size=1" in state["summary"]["error"]
