"""Step timing: warm-up steps apart, steady-state throughput over the measured ones."""

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class StepMeter:
    """Collects per-step wall times; the first `skip_steps` are warm-up (compile, caches)."""

    skip_steps: int
    start_time: float = field(default_factory=time.perf_counter)  # when the run began
    warmup_times_s: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: float = 0.0
    samples: int = 0
    tokens: int = 0
    time_to_first_step_s: float | None = None

    def add(self, step_time_s: float, data_wait_s: float, samples: int, tokens: int) -> None:
        if self.time_to_first_step_s is None:
            self.time_to_first_step_s = time.perf_counter() - self.start_time
        if len(self.warmup_times_s) < self.skip_steps:
            self.warmup_times_s.append(step_time_s)
            return
        self.step_times_s.append(step_time_s)
        self.data_wait_s += data_wait_s
        self.samples += samples
        self.tokens += tokens

    def state_dict(self) -> dict:
        """The counters, for a checkpoint (wall-clock origins are per process and not kept)."""
        return {k: v for k, v in vars(self).items() if k != "start_time"}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def summary(self) -> dict[str, float | int | None]:
        measured_s = sum(self.step_times_s)
        median = statistics.median(self.step_times_s) if self.step_times_s else None
        # Extra time of the warm-up steps over steady state: where compilation and cache warm-up go.
        compile_s = None
        if median is not None:
            compile_s = max(0.0, sum(self.warmup_times_s) - median * len(self.warmup_times_s))
        return {
            "timed_steps": len(self.step_times_s),
            "samples_per_s": self.samples / measured_s if measured_s else None,
            "tokens_per_s": self.tokens / measured_s if measured_s else None,
            "step_time_s": median,
            "data_wait_frac": self.data_wait_s / measured_s if measured_s else None,
            "compile_time_s": compile_s,
            "time_to_first_step_s": self.time_to_first_step_s,
        }
