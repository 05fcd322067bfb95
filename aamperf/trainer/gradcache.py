"""A step's forward and backward over its micro-batches (`trainer.grad_accum_steps`), exact for a pairwise
loss: gradient caching (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup").

The UniFrac part compares every pair of the step's samples, so its gradient is not a sum over
micro-batches. Pass 1 embeds every micro-batch without a graph; the pairwise part is taken once on all
of the embeddings (detached, requiring grad), which gives its gradient per embedding; pass 2 forwards
each micro-batch again, with its graph, and backpropagates its embeddings x that cached gradient plus
its share of the separable parts (nucleotides, target). The two forwards of a micro-batch draw the same
dropout (the random state saved before the first is restored before the second), so the step's
gradients are the whole batch's in fp32, at the cost of one more forward per micro-batch; the memory
of one micro-batch's graph, plus the step's embeddings.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from aamperf.data.loaders import split_batch
from aamperf.device import new_cuda_graph_step
from aamperf.distributed import world_size
from aamperf.phases import Plan

StepLoss = tuple[Tensor, dict[str, Tensor]]  # the step's loss (detached) and its parts


def accumulation(
    loss_fn: Callable, micro_batches: int, device: torch.device
) -> Callable[[Plan, dict, int], StepLoss]:
    """step(plan, batch, step) -> (loss, parts): forward and backward of a step's whole batch (the
    gradients left in the parameters). One micro-batch: the loss as it is; several: gradient caching
    where the loss offers it (`AAMLoss.micro_loss`), else each micro-batch on its own (a loss without
    pairs across samples: exact as it is)."""
    if micro_batches == 1:
        return lambda plan, batch, step: whole_batch(plan, loss_fn, batch, step, device)
    if caches_gradients(loss_fn, micro_batches):
        return lambda plan, batch, step: cached(plan, loss_fn, batch, step, micro_batches, device)
    return lambda plan, batch, step: one_by_one(plan, loss_fn, batch, step, micro_batches, device)


def caches_gradients(loss_fn: Callable, micro_batches: int) -> bool:
    """Whether a step of `micro_batches` trains by gradient caching: it then forwards each micro-batch
    twice (what the hardware FLOPs count)."""
    return micro_batches > 1 and hasattr(loss_fn, "micro_loss")


def whole_batch(plan: Plan, loss_fn: Callable, batch: dict, step: int, device: torch.device) -> StepLoss:
    with plan.grad_sync(True):
        new_cuda_graph_step(device)
        with plan.autocast():
            loss, parts = loss_fn(plan.model, batch, step)
        plan.scaler.scale(loss).backward()
    return loss.detach(), parts


def one_by_one(
    plan: Plan, loss_fn: Callable, batch: dict, step: int, micro_batches: int, device: torch.device
) -> StepLoss:
    """The mean of the micro-batches' losses, each taken on its own samples."""
    step_loss, parts = torch.zeros((), device=device), {}
    for m, micro in enumerate(split_batch(batch, micro_batches, world_size()), start=1):
        # distributed: gradients are reduced across ranks only after the last micro-batch
        with plan.grad_sync(m == micro_batches):
            new_cuda_graph_step(device)
            with plan.autocast():
                loss, parts = loss_fn(plan.model, micro, step)
            plan.scaler.scale(loss / micro_batches).backward()
        step_loss += loss.detach() / micro_batches
    return step_loss, parts  # the parts of the last micro-batch


def cached(
    plan: Plan, loss_fn: Any, batch: dict, step: int, micro_batches: int, device: torch.device
) -> StepLoss:
    """The whole batch's loss and gradients, by gradient caching (the module's docstring)."""
    micro = split_batch(batch, micro_batches, world_size())
    states, embeddings = [], []
    with torch.no_grad():  # pass 1: the embeddings only, no graph kept
        for part in micro:
            states.append(rng_state(device))
            new_cuda_graph_step(device)
            with plan.autocast():
                embedding = loss_fn.embed(plan.model, part, step)
            # a copy: a CUDA graph's output is overwritten by its next replay
            embeddings.append(None if embedding is None else embedding.detach().clone())
    grads: list[Tensor | None] = [None] * micro_batches
    parts: dict[str, Tensor] = {}
    if embeddings[0] is not None:
        whole = torch.cat(embeddings).requires_grad_()
        unifrac = loss_fn.pairwise(whole, batch["unifrac"])
        grads = list(torch.autograd.grad(unifrac, whole)[0].split([len(e) for e in embeddings]))
        parts["unifrac"] = unifrac.detach()
    counts = loss_fn.step_counts(micro, step)
    shares: dict[str, Tensor] = {}
    for m, (part, grad) in enumerate(zip(micro, grads, strict=True)):  # pass 2: each with its graph
        set_rng_state(states[m], device)  # the dropout of pass 1: the embeddings the gradient is of
        # distributed: gradients are reduced across ranks only after the last micro-batch
        with plan.grad_sync(m == micro_batches - 1):
            new_cuda_graph_step(device)
            with plan.autocast():
                backward, share = loss_fn.micro_loss(plan.model, part, step, grad, counts)
            plan.scaler.scale(backward).backward()
        for name, value in share.items():
            shares[name] = shares.get(name, 0) + value
    parts = {**parts, **shares}
    return loss_fn.combine(parts).detach(), parts


def rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The generators dropout draws from: the CPU's, and the CUDA device's where the model runs there."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
