"""Alerts: thresholds on what a run measures (throughput, validation loss, memory, GPU utilisation),
each with a warn and a critical level. Checked at the log lines; an alert is raised once per crossing
(not at every line while the value stays past it) into train.log, summary.json `alerts` and the
sinks (W&B `run.alert`). A critical alert stops the run where `alerts.stop_on_critical` says so."""

import logging
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig

log = logging.getLogger(__name__)
LEVELS = ("ok", "warn", "critical")


@dataclass
class Alert:
    step: int
    metric: str
    level: str  # warn | critical
    value: float
    threshold: float
    message: str


@dataclass
class Rule:
    metric: str
    floor: bool  # True: below the threshold is bad (throughput); False: above it (a loss)
    warn: float | None
    critical: float | None
    key: str  # the override that sets it

    def level(self, value: float) -> tuple[str, float | None]:
        for name, threshold in (("critical", self.critical), ("warn", self.warn)):
            if threshold is not None and (value < threshold if self.floor else value > threshold):
                return name, threshold
        return "ok", None


def check_alerts(cfg: DictConfig) -> list[str]:
    """Levels in the right order: a floor's critical below its warn, a ceiling's above."""
    problems = []
    for name, floor in (("samples_per_s", True), ("val_loss", False), ("gpu_util_percent", True)):
        warn, critical = cfg.alerts[name].warn, cfg.alerts[name].critical
        if warn is not None and critical is not None and (critical > warn if floor else critical < warn):
            side = "below" if floor else "above"
            problems.append(
                f"alerts.{name}.critical={critical} must be {side} alerts.{name}.warn={warn} (a "
                f"{'floor' if floor else 'ceiling'}: critical is the worse side)"
            )
    return problems


class Alerts:
    """The run's thresholds; `check(step, row, readings)` at each log line."""

    def __init__(self, cfg: DictConfig, record: Any = None):
        a, m = cfg.alerts, cfg.memory
        self.rules = [
            Rule(
                "samples_per_s", True, a.samples_per_s.warn, a.samples_per_s.critical, "alerts.samples_per_s"
            ),
            Rule("val_loss", False, a.val_loss.warn, a.val_loss.critical, "alerts.val_loss"),
            Rule(
                "memory_fraction",
                False,
                m.warn_fraction,
                m.max_fraction,
                "memory.warn_fraction / max_fraction",
            ),
            Rule(
                "gpu_util_percent",
                True,
                a.gpu_util_percent.warn,
                a.gpu_util_percent.critical,
                "alerts.gpu_util_percent",
            ),
        ]
        self.stop_on_critical = a.stop_on_critical
        self.record = record  # its sinks get each alert (W&B: run.alert)
        self.raised: list[dict[str, Any]] = []  # summary.json `alerts`, in the order raised
        self._state = {rule.metric: "ok" for rule in self.rules}

    def check(self, step: int, values: dict[str, float | None]) -> str | None:
        """Raise the alerts of these readings; a reason to stop the run, or None."""
        stop = None
        for rule in self.rules:
            value = values.get(rule.metric)
            if value is None:
                continue
            level, threshold = rule.level(value)
            before, self._state[rule.metric] = self._state[rule.metric], level
            if LEVELS.index(level) <= LEVELS.index(before):  # no worse than at the last line: said already
                continue
            side = "below" if rule.floor else "above"
            message = f"{rule.metric} {value:.4g} {side} its {level} level {threshold:g} ({rule.key})"
            alert = asdict(Alert(step, rule.metric, level, float(value), float(threshold), message))
            self.raised.append(alert)
            (log.error if level == "critical" else log.warning)("alert at step %d: %s", step, message)
            if self.record is not None:
                self.record.alert(alert)
            if level == "critical" and self.stop_on_critical and rule.metric != "memory_fraction":
                stop = f"critical alert: {message} (alerts.stop_on_critical=true)"
        return stop
