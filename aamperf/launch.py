"""`python -m aamperf.launch`: torchrun with aamperf's exit codes. It takes torchrun's arguments
unchanged (`python -m aamperf.launch --nproc_per_node=2 -m aamperf.train distributed=ddp ...`) and
runs torchrun's own launcher; where the ranks stop on bad input (2), a guard (3) or a signal (130,
143), the job shows their one line once and exits with their code, where torchrun would print its
failure report and exit 1. Any other failure gets torchrun's report. Each rank's intra-op threads
default to the usable cores shared out among the local ranks (torchrun's default is one)."""

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from aamperf.cgroups import core_budget
from aamperf.errors import EXIT_ABORTED, EXIT_BAD_INPUT, LAUNCHER_SHOWS_LINES, exit_bad_input

OUR_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_ABORTED, 130, 143)  # a rank that ends so writes one line
OUR_PREFIXES = ("error: ", "aborted: ")  # `interrupted:` lines: each rank prints its own
# torchrun's grace for the ranks after a signal: an option of torch 2.13's torchrun, a fixed 30 s in 2.11's
SHUTDOWN_TIMEOUT_OPTION = not torchrun.get_args_parser().parse_known_args(["--shutdown-timeout=1", "x"])[1]
if SHUTDOWN_TIMEOUT_OPTION:
    KILLED = (
        "a rank had not ended within torchrun's --shutdown-timeout (default 30 s) of the signal and was "
        "killed (before its checkpoint, if still in its step); give it longer than a step takes: "
        "--shutdown-timeout=<seconds>"
    )
else:
    KILLED = (
        "a rank had not ended within 30 s of the signal and was killed (before its checkpoint, if still in "
        f"its step); torch {torch.__version__}'s torchrun has no --shutdown-timeout to give it longer"
    )


def job_result(exc: ChildFailedError) -> tuple[int, list[str]] | None:
    """The job's exit code (its first failed rank's) and its lines (each different one once, in rank
    order), or None where a rank failed in a way aamperf did not end it (a bug, a kill from outside):
    then torchrun's report is the answer. Ranks the agent stopped after the first failure may end by
    its signal."""
    _, first = exc.get_first_failure()
    failures = exc.failures.values()
    if first.exitcode not in OUR_EXIT_CODES or any(
        f.exitcode not in OUR_EXIT_CODES and f.exitcode >= 0 for f in failures
    ):
        return None
    ours = [exc.failures[rank].message for rank in sorted(exc.failures)]
    lines = [m for m in ours if isinstance(m, str) and m.startswith(OUR_PREFIXES)]
    return first.exitcode, list(dict.fromkeys(lines))


class Held(logging.Filter):
    """Holds a logger's records back until the job's end says whether they are news."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextmanager
def agent_logs_held() -> Iterator[Held]:
    """The agent's lines about failed and stopped ranks ("failed (exitcode: 2) ...", "Sending process
    ... SIGTERM"), shown at the end unless the job ended in aamperf's own line (clear `held.records`)."""
    logger, held = logging.getLogger("torch.distributed.elastic.multiprocessing.api"), Held()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)


@record  # anything else: torchrun's own failure report, exit 1
def main(argv: Sequence[str] | None = None) -> None:
    args = torchrun.parse_args(argv)
    local_ranks = torchrun.determine_local_world_size(args.nproc_per_node)
    if local_ranks < 1:
        exit_bad_input(f"--nproc_per_node={args.nproc_per_node} must be >= 1 (processes on this node)")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, core_budget() // local_ranks))
    os.environ[LAUNCHER_SHOWS_LINES] = "1"
    with agent_logs_held() as held:
        try:
            torchrun.run(args)
            return
        except ChildFailedError as exc:
            result = job_result(exc)
            if result is None:
                raise
            held.records.clear()
        except SignalException as exc:  # the agent passed it on to the ranks, which said where they stopped
            # news only where a rank had not ended in time: the agent killed it
            held.records[:] = [r for r in held.records if r.getMessage().startswith("Unable to shutdown")]
            result = 128 + exc.sigval, [f"interrupted: {KILLED}"] if held.records else []
    code, lines = result
    for line in lines:
        print(line, file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
