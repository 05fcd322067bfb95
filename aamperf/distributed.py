"""torch.distributed: the process group from torchrun's environment and the collectives of the global
batch (`conf/distributed/`; the DDP / FSDP2 wrap is the phase `aamperf/phases/distributed.py`).

Every rank iterates the same seeded global batches and encodes its contiguous slice of each
(`aamperf/data/collate.py` Collate), so the data order is that of one process with the whole batch.
Losses that need the whole batch (UniFrac pairs) gather across ranks with autograd.
"""

import datetime
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import Tensor

from aamperf.errors import one_line

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def slurm_env() -> bool:
    """A SLURM task (hydra/launcher=slurm): the task layout is in SLURM's variables, not torchrun's."""
    return all(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"))


def adopt_slurm_env() -> None:
    """Set torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from SLURM's, with
    submitit's helper, so that one code path serves torchrun and SLURM tasks."""
    if torchrun_env() or not slurm_env():
        return
    from submitit.helpers import TorchDistributedEnvironment  # hydra-submitit-launcher's dependency

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # set by submitit's jobs; plain srun has not
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def check_distributed(cfg: DictConfig) -> list[str]:
    problems = []
    if cfg.distributed.strategy != "none" and not (torchrun_env() or slurm_env()):
        problems.append(
            f"distributed={cfg.distributed.strategy} needs torchrun's environment (RANK, WORLD_SIZE, ...): "
            f"torchrun --nproc_per_node=2 -m aamperf.train distributed={cfg.distributed.strategy} "
            "(or a SLURM task: hydra/launcher=slurm)"
        )
    world = 1
    if cfg.distributed.strategy != "none":
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    batch = cfg.trainer.batch_size  # "auto" (or a mistake check_config reports): no split to check
    if isinstance(batch, int) and batch % (world * cfg.trainer.grad_accum_steps):
        problems.append(
            f"trainer.batch_size={cfg.trainer.batch_size} (the global batch) must divide evenly into "
            f"{world} ranks x trainer.grad_accum_steps={cfg.trainer.grad_accum_steps}"
        )
    return problems


def init_world(cfg: DictConfig, device: torch.device) -> World:
    """Join the process group torchrun set up (a no-op for distributed=none)."""
    if cfg.distributed.strategy == "none":
        return World()
    return join_world(cfg.distributed.backend, cfg.distributed.timeout_s, device)


def join_world(backend: str, timeout_s: float, device: torch.device) -> World:
    """Join torchrun's process group: `backend` auto is nccl on GPU, gloo on CPU."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        global _waits, _joins
        timeout = datetime.timedelta(seconds=timeout_s)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _joins += 1  # every rank joins as often (one per job of a sweep)
        store = attempt_store(rank, world, timeout, _joins)
        # the timeout reaches every collective too: a stopped or dead peer ends the run, not hangs it
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        _waits = Waits(dist.PrefixStore("waits", store), timeout_s)
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]))


def attempt_store(rank: int, world: int, timeout: datetime.timedelta, join: int) -> dist.Store:
    """The rendezvous store of env:// (torchrun's agent store, or one hosted by rank 0), with keys under
    this restart attempt and the process's `join`-th process group: after torchrun --max-restarts, the
    process group of the new ranks must not read the addresses the killed attempt left in the agent's
    store, nor a sweep's next job those of the job before it (a rank that did joined a dead group and
    went on alone)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"aamperf/attempt_{attempt}/join_{join}", store)


PEER_LOST = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe")


def peer_lost(exc: BaseException, timeout_s: float) -> str | None:
    """The one line for a collective that failed because another rank stopped or died, else None."""
    if not (dist.is_available() and dist.is_initialized()) or not isinstance(exc, RuntimeError):
        return None
    text = one_line(exc)
    if isinstance(exc, PeerFailed):  # it said why: its own line is the one to read
        return f"rank {dist.get_rank()}: stopped with {text}"
    if not (isinstance(exc, dist.DistError) or any(s in text.lower() for s in PEER_LOST)):
        return None
    return (
        f"rank {dist.get_rank()}: a collective failed ({text[:160]}): another rank stopped, died or did "
        f"not answer within distributed.timeout_s={timeout_s:g}; trainer.resume=auto goes on from the last "
        "checkpoint"
    )


def close_world(completed: bool = True) -> None:
    """Leave the process group. After a completed run every rank waits for the others first, so none
    tears its connections down while a peer still uses them; after a failure, no barrier (a peer may
    never reach it): torchrun stops the others."""
    if not dist.is_initialized():
        return
    global _waits
    if completed:
        dist.barrier()
    dist.destroy_process_group()
    _waits = None


_alone = False  # set by `alone()`


@contextmanager
def alone() -> Iterator[None]:
    """This process as if it were the only one: the global batch's collectives (`gather`, `all_sum`)
    act on its own slice. For steps one rank runs by itself while the others wait for its answer
    (compile=auto's trial): a collective there would wait for ranks that never join it."""
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model a DDP wrapper holds (its `.module`), or the model itself (FSDP2 and torch.compile keep the
    model's attributes reachable on what they return)."""
    return getattr(model, "module", model)


def world_size() -> int:
    """The ranks of the process group; 1 for a single process, or inside `alone()`."""
    if _alone:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def from_main(value: Any) -> Any:
    """The first rank's `value` on every rank (any picklable object; itself for one process): what the
    ranks must agree on, decided or measured by the first."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Waits:
    """Waits for a rank that works alone (the first rank's probes and compile trial, a rank's compile),
    through the rendezvous store instead of a collective: a collective would give up after
    distributed.timeout_s, and a first compile can take longer. A working rank beats in the store (every
    second, or a quarter of `timeout_s` where that is shorter); a waiting rank gives up when the beat of
    a rank it waits for stops for `timeout_s` (that rank stopped or died), however long the work takes,
    and at once where that rank failed. Every rank makes the same waits in the same order, so their
    count names each one."""

    POLL_S = 0.05

    def __init__(self, store: dist.Store, timeout_s: float):
        self.store, self.timeout_s, self.count = store, timeout_s, 0
        self.beat_s = min(1.0, timeout_s / 4)

    def main_decides(self, decide: Callable[[], T]) -> T:
        wait = self._next()
        if dist.get_rank() == 0:
            return self._work(wait, decide)
        self._wait_for(wait, [0])
        return self._outcome(wait, 0)

    def every_rank(self, work: Callable[[], T]) -> T:
        wait = self._next()
        result = self._work(wait, work)
        others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
        self._wait_for(wait, others)
        for other in others:
            self._outcome(wait, other)  # raises where that rank failed
        return result

    def _next(self) -> str:
        self.count += 1
        return f"wait_{self.count}"

    def _work(self, wait: str, work: Callable[[], T]) -> T:
        """`work()` with this rank's beat; its result (or its failure's line) left for the others."""
        me, stop = dist.get_rank(), threading.Event()

        def beat() -> None:
            n = 0
            while True:
                try:
                    self.store.set(f"{wait}/beat_{me}", str(n))
                except Exception:  # the store is gone (its host died): the waiting ranks fail on their own
                    return
                n += 1
                if stop.wait(self.beat_s):
                    return

        beating = threading.Thread(target=beat, name=f"aamperf-{wait}-beat", daemon=True)
        beating.start()
        try:
            result = work()
        except BaseException as exc:
            with suppress(Exception):  # the store may be gone: this rank's own error is what counts
                self.store.set(f"{wait}/done_{me}", pickle.dumps(("failed", one_line(exc))))
            raise
        finally:
            stop.set()
            beating.join()
        self.store.set(f"{wait}/done_{me}", pickle.dumps(("done", result)))
        return result

    def _wait_for(self, wait: str, ranks: list[int]) -> None:
        heard = {r: (None, time.monotonic()) for r in ranks}  # each rank's last beat, and when it changed
        while pending := [r for r in ranks if not self.store.check([f"{wait}/done_{r}"])]:
            now = time.monotonic()
            for r in pending:
                key = f"{wait}/beat_{r}"
                beat = self.store.get(key) if self.store.check([key]) else None
                if beat != heard[r][0]:
                    heard[r] = (beat, now)
                elif now - heard[r][1] > self.timeout_s:
                    raise dist.DistError(f"timed out: rank {r} gave no sign of work for {self.timeout_s:g} s")
            time.sleep(self.POLL_S)

    def _outcome(self, wait: str, r: int) -> Any:
        status, value = pickle.loads(self.store.get(f"{wait}/done_{r}"))
        if status == "failed":
            raise PeerFailed(f"rank {r}, which failed while this rank waited for it: {value}")
        return value


class PeerFailed(dist.DistError):
    """The rank a `Waits` wait was for failed (its error's line is in the message)."""


_waits: Waits | None = None  # the group `join_world` joined; None for one process or a group joined elsewhere
_joins = 0


def main_decides(decide: Callable[[], T]) -> T:
    """`decide()` run by the first rank alone, its result on every rank (itself for one process): what
    the ranks must agree on, measured by the first (ranks measuring together would see each other's
    load). The others wait as long as it works on it (`Waits`)."""
    if world_size() == 1:
        return decide()
    if _waits is None:  # a group this module did not join: a broadcast, waiting distributed's timeout
        return from_main(decide() if dist.get_rank() == 0 else None)
    return _waits.main_decides(decide)


def every_rank(work: Callable[[], T]) -> T:
    """`work()` on every rank, each alone and for as long as it takes (a compile), then every rank waits
    for the others (`Waits`); this rank's result."""
    if world_size() == 1:
        return work()
    if _waits is None:
        result = work()
        dist.barrier()
        return result
    return _waits.every_rank(work)


def rank() -> int:
    """This process's rank in the process group; 0 for a single process."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Gather(torch.autograd.Function):
    """all_gather forward; backward: each slice's gradient summed over the ranks that used it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return gather_constant(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        # an all-reduce, not a reduce-scatter: gloo has only the former, and these are [B, D] embeddings
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        share = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * share : (dist.get_rank() + 1) * share]


def gather(x: Tensor) -> Tensor:
    """[b, ...] on each rank -> [world * b, ...] in rank order, differentiable: every rank computes the
    whole batch's loss from it, and each rank's slice gets the gradient summed over the ranks."""
    return x if world_size() == 1 else _Gather.apply(x)


@torch.no_grad()
def gather_constant(x: Tensor) -> Tensor:
    """Like `gather` for tensors that need no gradient (UniFrac rows, targets)."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


@torch.no_grad()
def all_sum(x: Tensor) -> Tensor:
    """The sum over ranks (a new tensor; no gradient)."""
    if world_size() == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x


def full_value(x: Tensor) -> Tensor:
    """A tensor as one process sees it: FSDP2's sharded DTensors (a gradient norm) gathered whole."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
