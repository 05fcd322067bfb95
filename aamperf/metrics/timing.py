"""Step timing: warm-up steps apart, steady-state throughput over the measured ones, and the clock
every elapsed time of a run is read on (from the process's start)."""

import os
import statistics
import time
from dataclasses import dataclass, field

import psutil

# The one process-wide fact a run needs: whether an earlier job already ran in this process (Hydra's
# basic launcher runs a sweep's jobs one after another in one process). Its time is not the next job's.
_jobs_started = [0]


def process_age_s() -> float:
    """Seconds since this process was created (the interpreter's launch: imports and Hydra's config
    composition included). Linux: /proc/self/stat's start time (clock ticks since boot) against
    CLOCK_BOOTTIME, exact to a tick; psutil's create_time() adds the boot time in whole seconds."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), after pid and (comm)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start
    except (OSError, ValueError, AttributeError):  # not Linux
        return time.time() - psutil.Process().create_time()


def job_origin(sweep_job: bool = False) -> tuple[float, str]:
    """(perf_counter value every elapsed time of this job counts from, what it is). The first job of a
    process counts from the process's start; a later one (an in-process sweep, a test, a notebook) from
    now, its own start, since the process's earlier time belongs to the jobs before it. A job of a
    sweep (`sweep_job`) always counts from its own start: the sweep's start (imports, the sweeper's
    set-up, a search's reference run) belongs to all its jobs, and the first job paired with the others
    must not carry it."""
    first = _jobs_started[0] == 0 and not sweep_job
    _jobs_started[0] += 1
    now = time.perf_counter()
    return (now - process_age_s(), "process_start") if first else (now, "job_start")


@dataclass
class StepMeter:
    """Collects per-step wall times; the first `skip_steps` are warm-up (compile, caches).

    `start_time`: the perf_counter origin of the job (`job_origin`), for time_to_first_step_s,
    duration_s and every metrics line's elapsed_s."""

    skip_steps: int
    start_time: float = field(default_factory=time.perf_counter)
    warmup_times_s: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: float = 0.0
    samples: int = 0
    tokens: int = 0
    time_to_first_step_s: float | None = None

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_time

    def add(self, step_time_s: float, data_wait_s: float, samples: int, tokens: int) -> None:
        if self.time_to_first_step_s is None:
            self.time_to_first_step_s = self.elapsed_s()
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
        """Throughput and step time over the same timed steps by the same statistic (the mean), so that
        samples_per_s == batch / step_time_s for a fixed batch; the median is there under its own name."""
        measured_s = sum(self.step_times_s)
        n = len(self.step_times_s)
        median = statistics.median(self.step_times_s) if n else None
        # Extra time of the warm-up steps over a typical (median) step: compilation where the run compiles
        # (its compile_time_s: `Summary.completed`), first allocations and cache warm-up in any run.
        excess_s = None
        if median is not None:
            excess_s = max(0.0, sum(self.warmup_times_s) - median * len(self.warmup_times_s))
        return {
            "timed_steps": n,
            "timed_s": measured_s,
            "samples_per_s": self.samples / measured_s if measured_s else None,
            "tokens_per_s": self.tokens / measured_s if measured_s else None,
            "step_time_s": measured_s / n if n else None,
            "step_time_median_s": median,
            "data_wait_frac": self.data_wait_s / measured_s if measured_s else None,
            "warmup_excess_s": excess_s,
            "time_to_first_step_s": self.time_to_first_step_s,
        }
