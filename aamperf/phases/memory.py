"""Activation checkpointing per transformer layer or per op, or within torch.compile's activation memory
budget, and CUDA allocator settings (the memory guard that watches a run is in aamperf/guards/memory.py)."""

import logging
from functools import partial

import torch
import torch._functorch.config as functorch_config
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from aamperf.model.layers import Block
from aamperf.phases.record import applied, skipped

log = logging.getLogger(__name__)

# torch's own activation memory budget (1.0: compile's partitioner keeps what it would save, recomputing
# only what costs nothing to)
UNBUDGETED = functorch_config.activation_memory_budget

_aten = torch.ops.aten
# memory=ops keeps the outputs of these (the matmuls and attention kernels: nearly all of a block's FLOPs)
# and recomputes every other op of the block in backward (layer norms, GELU, dropout, softmax, adds: cheap,
# and most of the bytes). aten.linear and matmul decompose into mm / addmm / bmm before the policy sees
# them; linear is listed for a backend that keeps it whole.
SAVED_OPS = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten.linear,
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
}


def keep_matmuls(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The selective-checkpoint policy of memory=ops: save what SAVED_OPS return, recompute the rest."""
    # Not under no_grad, as inside a custom autograd.Function's forward (attention=sdpa's chunked
    # dropout attention on a CPU): its ops are no part of the graph, and it writes into their outputs in
    # place, which a saved output may not be ("Tensor cached during selective activation checkpoint has
    # been mutated"); backward recomputes such a Function whole, as memory=full does
    if func.overloadpacket in SAVED_OPS and torch.is_grad_enabled():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def ops_contexts():
    """memory=ops's context_fn for torch.utils.checkpoint (a new pair of contexts per call)."""
    return create_selective_checkpoint_contexts(keep_matmuls)


def check_memory(cfg: DictConfig, compile_cfg: DictConfig) -> list[str]:
    """`cfg`: the memory group; `compile_cfg`: the compile group, which memory=budget acts through."""
    problems = []
    if cfg.checkpointing == "budget" and compile_cfg.mode == "disabled":
        problems.append(
            "memory=budget is torch.compile's activation memory budget and compile is disabled: add "
            "compile=auto or compile=default, or take memory=ops (the same trade in eager)"
        )
    elif cfg.checkpointing == "budget" and compile_cfg.backend != "inductor":
        problems.append(
            f"memory=budget keeps dropout's masks right by a pass of inductor's, and compile.backend="
            f"{compile_cfg.backend}: set compile.backend=inductor, or take memory=ops"
        )
    if cfg.recompute_every < 1:
        problems.append(f"memory.recompute_every={cfg.recompute_every} must be >= 1")
    # 0 would save the graph's inputs alone: torch then recomputes the seeds that the rules of
    # aamperf/phases/recompute.py keep
    if not 0 < cfg.activation_budget <= 1:
        problems.append(f"memory.activation_budget={cfg.activation_budget} must be in (0, 1]")
    if not 0 < cfg.warn_fraction <= 1:
        problems.append(f"memory.warn_fraction={cfg.warn_fraction} must be in (0, 1]")
    if not 0 < cfg.max_fraction <= 1:
        problems.append(f"memory.max_fraction={cfg.max_fraction} must be in (0, 1]")
    return problems


def apply_checkpointing(model: nn.Module, cfg: DictConfig, compiles: bool = True) -> dict:
    """Wrap transformer layers so their activations are recomputed in backward instead of kept.

    full: every layer; selective: layers 0, k, 2k, ... of each stack (k = memory.recompute_every); ops:
    every layer, keeping its matmuls' and attention's outputs and recomputing only the other ops; budget:
    no wrapper, torch.compile's partitioner keeps at most memory.activation_budget of the bytes it would
    save for backward (the compile phase, later, builds the graphs it acts in).
    The wrapper keeps state_dict keys unchanged (checkpoints stay loadable either way). `compiles`: the
    compile phase may compile the model (compile.mode is not disabled): only then are aamperf's rules
    over inductor's graphs set (an eager run leaves inductor's config as torch has it).
    """
    budget = cfg.checkpointing == "budget"
    set_compiled_recompute(
        compiles and cfg.checkpointing != "none", cfg.activation_budget if budget else UNBUDGETED
    )
    if budget:
        return applied(
            mode="budget",
            activation_budget=cfg.activation_budget,
            solver=functorch_config.activation_memory_budget_solver,
            runtime_estimator=functorch_config.activation_memory_budget_runtime_estimator,
        )
    if cfg.checkpointing == "none":
        return skipped("memory.checkpointing=none")
    every = cfg.recompute_every if cfg.checkpointing == "selective" else 1
    # non-reentrant torch.utils.checkpoint; memory=ops: with a policy per op (selective checkpointing)
    ops = cfg.checkpointing == "ops"
    wrap = partial(checkpoint_wrapper, context_fn=ops_contexts) if ops else checkpoint_wrapper
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, nn.ModuleList) and any(isinstance(m, Block) for m in parent):
            for i, block in enumerate(parent):
                if isinstance(block, Block) and i % every == 0:
                    parent[i] = wrap(block)
                    # the FLOP count's: a block that recomputes no matmul costs no extra matmul FLOPs
                    parent[i].recomputes_matmuls = not ops
                    wrapped += 1
    if not wrapped:
        return skipped("the model has no transformer Block to checkpoint")
    details = {"saved_ops": sorted(str(op) for op in SAVED_OPS)} if ops else {}
    return applied(mode=cfg.checkpointing, every=every, layers=wrapped, **details)


_rules_set = False  # an earlier job of this process set aamperf's pass over inductor's joint graph


def set_compiled_recompute(recomputes: bool, budget: float) -> None:
    """What torch.compile's graphs compiled from now on recompute, process-wide: set by every job, so a job
    of an in-process sweep does not inherit the previous job's. `budget`: the activation memory budget
    (UNBUDGETED but under memory=budget); where compiled graphs recompute, aamperf's rules over inductor's
    joint graph (aamperf/phases/recompute.py): graph inputs saved (a checkpoint wrapper compiled with
    dynamic shapes, on torch 2.11), randomness kept under a budget below 1. A graph compiled under
    another budget is dropped: dynamo would reuse it (its guards are on the code and the tensors' types,
    not on this setting), and a block compiled by an earlier job would keep that job's budget."""
    global _rules_set
    if recomputes or _rules_set:
        from aamperf.phases.recompute import INPUTS_SAVED, RANDOMNESS_KEPT  # inductor: imported where used

        rules = (RANDOMNESS_KEPT if budget < 1 else INPUTS_SAVED) if recomputes else None
        torch._inductor.config.joint_custom_post_pass = rules
        _rules_set = recomputes
    if functorch_config.activation_memory_budget != budget:
        functorch_config.activation_memory_budget = budget
        torch._dynamo.reset()


def budget_unused(record: dict, compile_record: dict) -> dict:
    """memory=budget's record once the compile phase has run: the budget acts in compiled graphs only."""
    if record.get("mode") != "budget" or compile_record["status"] == "applied":
        return record
    why = compile_record["reason"]
    reason = f"memory=budget acts in torch.compile's graphs, and the model runs eager ({why})"
    log.warning(f"{reason}: every activation kept (memory=full or ops recompute in eager)")
    return skipped(reason, **{k: v for k, v in record.items() if k not in ("status", "reason")})


_expandable = False  # an earlier job of this process turned expandable segments on


def set_expandable_segments(enabled: bool) -> None:
    """The CUDA caching allocator's expandable segments, from now on (segments it makes later)."""
    setting = f"expandable_segments:{enabled}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # its newer name
    (setter or torch.cuda.memory._set_allocator_settings)(setting)


def apply_cuda_memory(cfg: DictConfig, device: torch.device) -> dict:
    """Allocator settings that only exist on a GPU. Both are set for every job, so a job of an
    in-process sweep does not inherit the previous job's."""
    if device.type != "cuda":
        return skipped(f"no GPU ({device.type}): CUDA memory fraction and expandable segments do not apply")
    done = {}
    # PYTORCH_CUDA_ALLOC_CONF is read once, when CUDA starts, which is earlier here (the phases'
    # checks run on the device): the allocator's own setter applies it to the segments made from now
    global _expandable
    if cfg.expandable_segments or _expandable:
        set_expandable_segments(cfg.expandable_segments)
        _expandable = cfg.expandable_segments
    if cfg.expandable_segments:
        done["expandable_segments"] = True
    # torch wants the GPU's index: torch.device("cuda") (no index) means the current one
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(cfg.cuda_memory_fraction or 1.0, index)
    if cfg.cuda_memory_fraction is not None:
        done["memory_fraction"] = cfg.cuda_memory_fraction
    return applied(**done) if done else skipped("no CUDA memory setting chosen")
