"""Metric sinks beside metrics.jsonl (`conf/logger/`): Weights & Biases and TensorBoard.

A sink gets every logged row and the final summary. It never stops training: a sink that fails
says so once on stderr and in summary.json (`logger`) and is switched off.
"""

import netrc
import os
import socket
import sys
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from omegaconf import DictConfig

from aamperf.errors import one_line

SECTIONS = {  # metrics.jsonl key -> the panel section it belongs to in W&B / TensorBoard
    "loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "step_time_s": "perf",
    "samples_per_s": "perf",
    "tokens_per_s": "perf",
    "data_wait_frac": "perf",
    "rss_bytes": "mem",
    "cpu_percent": "sys",
    "elapsed_s": "sys",
}


def metric_name(key: str) -> str:
    """`loss_unifrac` -> `train/loss_unifrac`, `val_loss` -> `val/loss`, `rss_bytes` -> `mem/rss_bytes`."""
    if key.startswith("val_"):
        return "val/" + key.removeprefix("val_")
    if key.startswith("loss_"):
        return "train/" + key
    if key.endswith("_bytes"):
        return "mem/" + key
    return f"{SECTIONS.get(key, 'sys')}/{key}"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    return {
        metric_name(k): v
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class Sink(Protocol):
    info: dict[str, Any]

    def log(self, row: dict[str, Any]) -> None: ...
    def alert(self, alert: dict[str, Any]) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def close(self, failed: bool) -> None: ...


def job_identity(cfg: DictConfig) -> tuple[str | None, str]:
    """(group, name) of this job: the sweep's directory name and the job's overrides under Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # train() called from Python
        return cfg.logger.group, f"optim={cfg.optim}"
    hydra_cfg = HydraConfig.get()
    group = cfg.logger.group
    if group is None and hydra_cfg.mode == RunMode.MULTIRUN:
        group = sweep_group(hydra_cfg.sweep.dir)
    return group, " ".join(hydra_cfg.overrides.task) or f"optim={cfg.optim}"


def sweep_group(sweep_dir: str | Path) -> str:
    """outputs/multirun/2026-11-22/04-50-00 -> 2026-11-22_04-50-00; any other directory -> its name."""
    parts = Path(sweep_dir).parts
    if "multirun" in parts[:-1]:
        return "_".join(parts[parts.index("multirun") + 1 :])
    return parts[-1]


def wandb_base_url() -> str:
    """The W&B server wandb itself would use: WANDB_BASE_URL, else its settings files (`wandb login
    --host`), else its own default (which moves between wandb versions)."""
    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    import wandb

    return str(wandb.setup().settings.base_url)


def netrc_hosts(base_url: str) -> list[str]:
    """The .netrc machines a key for `base_url` may be under: its host, and for a CoreWeave Forge host the
    W&B API host behind it (wandb reads both)."""
    hosts = [urlparse(base_url).netloc]
    try:
        from wandb.sdk.lib.urls import forge_upstream_url  # wandb >= 0.31; earlier ones have no Forge
    except ImportError:
        return hosts
    return hosts + [urlparse(forge_upstream_url(base_url)).netloc]


def wandb_mode(cfg: DictConfig) -> str | None:
    """The W&B mode to start in: online only where an API key is configured (env, wandb's settings, or
    the .netrc entry of the server wandb would use), never a login prompt."""
    if cfg.logger.mode != "auto":
        return cfg.logger.mode
    if os.environ.get("WANDB_MODE"):
        return None  # the user's environment decides
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import wandb

    if wandb.setup().settings.api_key:
        return "online"
    try:
        entries = netrc.netrc(os.environ.get("NETRC") or None)
    except (OSError, netrc.NetrcParseError):
        return "offline"
    return "online" if any(entries.authenticators(h) for h in netrc_hosts(wandb_base_url())) else "offline"


REACH_TIMEOUT_S = 5.0  # a TCP connection to the W&B server (or its proxy); wandb.init waits 30 s
_unreachable: dict[str, str | None] = {}  # host:port -> why it cannot be reached (None: it can), per process


def wandb_unreachable() -> str | None:
    """Why this machine cannot reach the W&B server (`WANDB_BASE_URL`, or the HTTPS proxy that leads
    there), None where it can: one TCP connection per process, at most REACH_TIMEOUT_S. A compute node
    without internet fails it at once (its DNS knows no such host), where wandb.init would retry for its
    whole init_timeout first, in every run and every job of a sweep."""
    base = urlparse(wandb_base_url())
    proxy = urllib.request.getproxies().get(base.scheme)
    target = urlparse(proxy) if proxy and not urllib.request.proxy_bypass(base.hostname or "") else base
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    where = f"{host}:{port}"
    if where not in _unreachable:
        try:
            socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
            _unreachable[where] = None
        except OSError as exc:
            _unreachable[where] = f"cannot reach the W&B server at {where} ({exc.strerror or exc})"
    return _unreachable[where]


def start_wandb(cfg: DictConfig, directory: Path, **init: Any):
    """wandb.init in the configured mode, falling back to offline when online fails (no network, bad key).
    Returns (run, info)."""
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", init_timeout=30, x_disable_stats=True)
    kwargs = dict(project=cfg.logger.project, entity=cfg.logger.entity, dir=str(directory), settings=settings)
    mode = wandb_mode(cfg)
    try:
        unreachable = wandb_unreachable() if mode == "online" else None
        if unreachable:
            raise ConnectionError(unreachable)
        run = wandb.init(mode=mode, tags=list(cfg.logger.tags), **kwargs, **init)
        return run, {"backend": "wandb", "mode": run.settings.mode}
    except Exception as exc:  # never let W&B stop training: keep the run on disk for `wandb sync`
        reason = one_line(exc)[:200]
        print(f"warning: W&B could not start {mode or 'online'} ({reason}); logging offline", file=sys.stderr)
        run = wandb.init(mode="offline", tags=list(cfg.logger.tags), **kwargs, **init)
        return run, {"backend": "wandb", "mode": "offline", "fallback": reason}


class WandbSink:
    """One W&B run per job: group = the sweep, job_type = the optimization level, name = the overrides."""

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict[str, Any]):
        group, name = job_identity(cfg)
        self.run, self.info = start_wandb(
            cfg, run_dir, group=group, job_type=str(cfg.optim), name=name, config=config, reinit="create_new"
        )
        self.info.update(group=group, dir=self.run.dir)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def alert(self, alert: dict[str, Any]) -> None:
        import wandb

        level = wandb.AlertLevel.ERROR if alert["level"] == "critical" else wandb.AlertLevel.WARN
        title = f"{alert['level']}: {alert['metric']}"
        self.run.alert(title=title, text=f"step {alert['step']}: {alert['message']}", level=level)

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if k != "config" and v is not None})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TensorBoardSink:
    """The same scalars as W&B, as event files in <run_dir>/tensorboard (`tensorboard --logdir outputs`)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("needs the tensorboard package: pip install tensorboard") from exc
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.info = {"backend": "tensorboard", "dir": self.writer.log_dir}
        self._last_step = 0

    def log(self, row: dict[str, Any]) -> None:
        self._last_step = row["step"]
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])

    def alert(self, alert: dict[str, Any]) -> None:
        self.writer.add_text(
            f"alerts/{alert['metric']}", f"{alert['level']}: {alert['message']}", alert["step"]
        )

    def summary(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"summary/{key}", value, self._last_step)

    def close(self, failed: bool) -> None:
        self.writer.close()


SINKS = {"wandb": WandbSink, "tensorboard": TensorBoardSink}


def open_sinks(cfg: DictConfig, run_dir: Path, config: dict[str, Any]) -> list[Sink]:
    """The sinks `logger.backend` asks for; one that cannot start is reported and left out."""
    backend = cfg.logger.backend
    if backend not in SINKS:
        return []  # logger=none
    try:
        return [SINKS[backend](cfg, run_dir, config)]
    except Exception as exc:
        warnings.warn(f"logger={backend} is off for this run: {exc}", stacklevel=2)
        return []


def log_comparison(result: dict[str, Any], sweep_dir: Path, config: DictConfig) -> None:
    """The comparison as a W&B Table (and the figure) in a `comparison` run of the sweep's group."""
    import wandb

    rows = [
        {k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in row.items()}
        for row in result["rows"]
    ]
    columns = list(rows[0])
    group = config.logger.group or sweep_group(sweep_dir)
    try:
        run, _ = start_wandb(config, sweep_dir, group=group, job_type="comparison", name="comparison")
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        run.log({"comparison": table, "comparison_plot": wandb.Image(str(sweep_dir / "comparison.png"))})
        run.summary.update({"baseline": result["baseline"]})
        run.finish()
    except Exception as exc:  # the local report is written already
        print(f"warning: comparison not logged to W&B: {exc}", file=sys.stderr)
