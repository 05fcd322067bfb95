"""The distributed wrap, the last model transform: DDP or FSDP2 (fully_shard per transformer layer + root)."""

import contextlib

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from aamperf.distributed import World
from aamperf.phases.record import applied, skipped


def grad_sync(model: nn.Module):
    """grad_sync(enabled) -> a context: DDP's no_sync / FSDP2's gradient-sync switch during accumulation."""
    if hasattr(model, "no_sync"):  # DDP
        return lambda enabled: contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def sync(enabled: bool):
            model.set_requires_gradient_sync(enabled)
            yield

        return sync
    return lambda enabled: contextlib.nullcontext()


def check_comm_hook(cfg: DictConfig, device: torch.device) -> list[str]:
    """The gradient compression the device can run: torch's bf16 hook needs NCCL (CUDA)."""
    if cfg.strategy == "ddp" and cfg.comm_hook == "bf16" and device.type != "cuda":
        return [
            f"distributed.comm_hook=bf16 needs CUDA (torch's bf16 hook runs on NCCL only); on "
            f"{device.type} use distributed.comm_hook=fp16 or none"
        ]
    return []


def wrap_model(model: nn.Module, cfg: DictConfig, world: World, device: torch.device, param_dtype) -> tuple:
    """DDP or FSDP2 around the (checkpointed, compiled) model: the last model transform, before the
    optimizer is built. Returns (model, record)."""
    dc = cfg.distributed
    if dc.strategy == "none":
        return model, skipped("distributed=none (one process)")
    if dc.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=dc.bucket_cap_mb,
            static_graph=dc.static_graph,
            find_unused_parameters=dc.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
        if dc.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
            ddp.register_comm_hook(None, hook[dc.comm_hook])
        return ddp, applied(
            strategy="ddp",
            world_size=world.world_size,
            backend=dist.get_backend(),
            bucket_cap_mb=dc.bucket_cap_mb,
            static_graph=dc.static_graph,
            comm_hook=dc.comm_hook,
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from aamperf.model.layers import Block

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:  # each transformer layer its own unit: its parameters gathered only while it runs
        fully_shard(block, mp_policy=policy, reshard_after_forward=dc.reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=dc.reshard_after_forward)
    return model, applied(
        strategy="fsdp",
        world_size=world.world_size,
        backend=dist.get_backend(),
        units=len(blocks) + 1,
        param_dtype=str(param_dtype).removeprefix("torch."),
        reduce_dtype="float32",
        reshard_after_forward=dc.reshard_after_forward,
    )
