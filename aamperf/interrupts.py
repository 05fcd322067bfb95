"""SIGTERM, SIGINT and SLURM's preemption signal: the step in progress finishes, a checkpoint is written,
the run ends with status `interrupted` and exit code 128 + the signal's number (143, 130); a second
signal ends the process at once.

SLURM, Kubernetes and torchrun send SIGTERM before they kill; Ctrl-C sends SIGINT. Under
hydra/launcher=slurm, submitit asks for its preemption signal (SIGUSR2) before a time limit or a
preemption and requeues the job from its handler: that handler runs after the checkpoint, so the
requeued job goes on from it with trainer.resume=auto.
"""

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from aamperf.errors import RunAborted, exit_with, one_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class RunInterrupted(RunAborted):
    """A signal stopped the run after a whole step: status `interrupted`, exit code 128 + signal."""

    def __init__(self, message: str, result: Any, signum: int):
        super().__init__(message, result)
        self.signum = signum
        self.exit_code = 128 + signum


class StopSignal(BaseException):  # noqa: N818 - named for what it is, as KeyboardInterrupt
    """What the handler raises outside the training loop. A BaseException, as KeyboardInterrupt is, so
    that code catching Exception lets it through: inductor's compile caught a RunInterrupted raised in
    it, the compile went on, and the device probe cached "torch.compile does not work here". The run
    ends with its `interrupted` (aamperf/run.py; `Interrupts` turns one raised elsewhere into it)."""

    def __init__(self, interrupted: RunInterrupted):
        super().__init__(str(interrupted))
        self.interrupted = interrupted


_active: "Interrupts | None" = None  # the run's, while it catches the stop signals
_stopped_at_once: RunInterrupted | None = None  # stop_at_once's signal, once one came


def stop_if_signalled() -> None:
    """Stop the run (or the command under `stop_at_once`) where a signal came and the code it interrupted
    caught even the handler's StopSignal (a bare `except:`). Called after each measurement, before it is
    kept, as the training loop begins, and before predict writes its files."""
    if _active is not None:
        _active.stop_if_received()
    if _stopped_at_once is not None:
        raise StopSignal(_stopped_at_once)


def exit_interrupted(exc: RunInterrupted) -> NoReturn:
    exit_with(f"interrupted: {one_line(exc)}", exc.exit_code)


@contextmanager
def stop_at_once(left: str) -> Iterator[None]:
    """For a command with nothing to save midway (`python -m aamperf.predict`): SIGTERM or SIGINT ends it
    at once with one `interrupted:` line saying what is `left`, and exit code 128 + the signal (not a
    KeyboardInterrupt's traceback, or SIGTERM's silent death). A signal whose StopSignal the code it
    interrupted swallowed still ends the command so, at the next `stop_if_signalled` or at the end."""
    global _stopped_at_once

    def handle(signum: int, frame: FrameType | None) -> None:
        global _stopped_at_once
        name = signal.Signals(signum).name
        _stopped_at_once = _stopped_at_once or RunInterrupted(f"{name} received; {left}", None, signum)
        raise StopSignal(_stopped_at_once)

    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, handle) for signum in stops}
    try:
        with resent_when_dropped():
            yield
            stop_if_signalled()
    except StopSignal as stop:
        exit_interrupted(stop.interrupted)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stopped_at_once = None


@contextmanager
def resent_when_dropped() -> Iterator[None]:
    """A signal handled while a finalizer runs (a weakref's callback, a `__del__`) raises its StopSignal
    there, and Python drops an exception raised in a finalizer (it prints "Exception ignored in ..."):
    the command went on to the end, exit 0 (predict, a SIGINT that came as a weakref was removed). Here the
    dropped StopSignal's signal is sent again a moment later, to be handled in the code the finalizer
    interrupted."""
    timers: list[threading.Timer] = []

    def dropped(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, StopSignal):
            return hook(unraisable)
        # not sent from here: the handler would run in this hook, whose exceptions are dropped too
        again = threading.Timer(0.01, os.kill, (os.getpid(), unraisable.exc_value.interrupted.signum))
        again.daemon = True
        timers.append(again)
        again.start()

    hook, sys.unraisablehook = sys.unraisablehook, dropped
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for timer in timers:
            timer.cancel()


def preemption_signal() -> signal.Signals | None:
    """submitit's preemption signal where this process is a submitit job, else None."""
    if "SUBMITIT_EXECUTOR" not in os.environ:  # set in every submitit job (slurm, local)
        return None
    return signal.Signals[f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2').removeprefix('SIG')}"]


class Interrupts:
    """Catches the stop signals while a run is on. Outside the training loop (set-up, validation is
    inside) a signal stops the run at once; inside it, `requested()` says so at the end of a step."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this process was sent
        self.signum: int | None = None  # the one the run stops for: its own, or (distributed) a peer's
        self.in_loop = False
        self.loop_ended = False  # set when the loop ends: a signal then comes while the run is being saved
        self.sigint_keeps = True  # SIGINT writes a checkpoint only where the run keeps them (fit sets it)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Interrupts":
        global _active
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in (signal.SIGTERM, signal.SIGINT, preemption_signal()):
                if signum is not None:
                    self._previous[signum] = signal.signal(signum, self._handle)
            _active = self
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        global _active
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if _active is self:
            _active = None
        if isinstance(exc, StopSignal):
            raise exc.interrupted from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # a second signal to this process: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        if not self.in_loop:
            raise StopSignal(self._stopped())
        kept = "with a checkpoint" if signum != signal.SIGINT or self.sigint_keeps else "(no checkpoint)"
        name = signal.Signals(signum).name
        log.warning(f"{name} received: stopping after this step {kept} (again: at once)")

    def stop_if_received(self) -> None:
        """Outside the training loop, a signal received stops the run at once: the handler raises, and
        this raises again where code in between caught what it raised (`stop_if_signalled`)."""
        if self.received is not None and not self.in_loop:
            raise self._stopped()

    def _stopped(self) -> RunInterrupted:
        self.signum = self.received
        when = (
            "after the last step, before the run's model and summary were written"
            if self.loop_ended
            else "before training began; nothing to keep"
        )
        return RunInterrupted(f"{signal.Signals(self.received).name} received {when}", None, self.received)

    def requested(self, device: "torch.device") -> bool:
        """Did a signal arrive? Distributed, every rank learns whether any rank received one (one
        all-reduce of a number per step), so all of them stop after the same step. The answer is the
        all-reduce's on every rank: a signal that comes while it runs counts at the next step."""
        # imported here: aamperf.compare imports this module (stop_at_once) and needs no torch
        import torch
        import torch.distributed as dist

        from aamperf.distributed import world_size

        if world_size() == 1:
            agreed = self.received or 0
        else:
            got = torch.tensor([self.received or 0], device=device)
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
            agreed = int(got.item())  # host sync: once per step, distributed runs only
        self.signum = agreed or None
        return self.signum is not None

    def hand_on(self) -> None:
        """After the checkpoint, on the preemption signal: submitit's own handler (it requeues the job)."""
        previous = self._previous.get(self.signum) if self.signum == preemption_signal() else None
        if callable(previous):
            previous(self.signum, None)
