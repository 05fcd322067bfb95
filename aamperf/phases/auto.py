"""`auto` options resolved on the device the run has, from the probe's measurements (`aamperf/probe.py`).

Each decision is recorded in summary.json `phases.<group>.auto`: what was chosen, the measured reason,
and the evidence (the probe's figures, whether they were cached or measured in this run).
- precision=auto: the low-precision autocast dtype whose matmuls at the model's shapes beat fp32's by
  MIN_MATMUL_GAIN, else fp32. On a GPU, training steps under it and under fp32 then confirm it
  (`phases.confirm_low_precision`: a faster matmul did not make a faster step on an H100).
- attention=auto: SDPA where one of its kernels runs here and its forward + backward at the model's
  attention shape takes at most MIN_MATH_GAIN x the written-out math's time, else the math. On a GPU
  whose rows change from batch to batch (no bucketing), timed at row counts not run before, with SDPA
  without cuDNN's kernel as a candidate too (cuDNN builds a plan per shape).
- memory=auto: every k-th transformer layer recomputed in backward (selective) where the activations are
  kept in fp32 and the attention is the written-out math (which keeps its [rows, heads, L, L]
  probabilities for backward), none otherwise. Measured at the headline's batch (experiments/memory/,
  AVX-512 EPYC, 2026-11-24, against the baseline's 2.37 GiB peak RSS, which recomputes every layer):
  fp32 with the math 2.52 GiB kept, 2.16 with every 2nd layer recomputed; fp32 with SDPA (on CPU with
  dropout: the chunked math, 1-byte dropout masks) 2.01 kept, 1.86 recomputed for +17-30% step time;
  in bf16, keeping them all was 0.83x and 0.97x the baseline (two studies of 2026-11-23).
compile=auto and dataloader=auto need the run's own model and batches: `phases/compile.py` and
`phases/dataloader.py` decide them by timing real steps.
"""

from typing import Any

import torch
from omegaconf import DictConfig

from aamperf.distributed import main_decides
from aamperf.phases.precision import DTYPES
from aamperf.probe import Probe, model_shapes
from aamperf.probe_measures import low_precision_dtypes

MIN_MATMUL_GAIN = 1.15  # autocast adds casts around every matmul: a smaller matmul gain does not cover them
# The math must beat SDPA by this much to be chosen: it keeps its [rows, heads, L, L] probabilities for
# backward (SDPA keeps none), nearer ratios are the probe's own noise, and the attention alone is not the
# step. At the headline's shape ([256, 4, 151, 32], bf16, dropout 0.1; 2-core AVX-512 EPYC, 2026-11-28) the
# probe in a run said 1.00x, 1.12x and 1.16x, and 8 repeats in turn 0.92-1.13x (experiments/headline/
# attention_probe.py, tcmalloc preloaded as in a run); whole steps
# with SDPA ran 0.97x [0.85, 1.05] the math's (a tie, 5 paired seeds) at 0.81x the peak memory
# (experiments/headline/attention-tie-avx512bf16-2026-11-28.md). Runs at such ratios chose either. At
# aam_small's shape it is a trade: steps 0.95x [0.92, 0.97] at 0.91x the peak (experiments/default/), where
# the probe's medians are 1.05-1.09x (1.04-1.07x at the headline's): it cannot tell the two apart; the
# margin prefers memory.
# Training only: a forward pass alone (prediction) keeps nothing for backward, and takes the quicker.
MIN_MATH_GAIN = 1.25
DEFAULT_ATTENTION = (32, 4, 128, 32)  # [N, heads, L, head_dim] for a model whose config does not say


def decided(choice: Any, reason: str, **evidence: Any) -> dict[str, Any]:
    return {"chose": choice, "reason": reason, **evidence}


def _load_note(answer: dict) -> str:
    if answer.get("source") == "measured_under_load":
        return f" (measured under load: {answer['under_load']}; not cached)"
    return ""


def choose_precision(device: torch.device, probe: Probe, shapes: list[tuple[int, int, int]]) -> dict:
    """The autocast dtype for `device`: the fastest matmul dtype at `shapes`, fp32 unless one gains enough."""
    answer = probe.matmul(shapes)
    flops = answer["flops"]
    gains = {dtype: flops[dtype] / flops["fp32"] for dtype in low_precision_dtypes(device) if dtype in flops}
    best = max(gains, key=gains.get)
    choice = best if gains[best] >= MIN_MATMUL_GAIN else "fp32"
    # AAM's shapes come from its config; another model's are not known before it runs: the probe's square
    square = "x".join(map(str, answer["shapes"][0])) if answer["shapes"] else "square"
    where = "at the model's shapes" if shapes else f"at a {square} matmul (this model's shapes are not known)"
    reason = (
        f"{best} matmul {gains[best]:.2f}x fp32 {where} here "
        f"({'>=' if choice != 'fp32' else '<'} {MIN_MATMUL_GAIN}): {choice}" + _load_note(answer)
    )
    return decided(choice, reason, matmul_flops=flops, source=answer["source"], shapes=answer["shapes"])


def choose_attention(
    device: torch.device,
    probe: Probe,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int] | None,
    *,
    backward: bool = True,
    dropout: tuple[float, str] = (0.0, "standard"),
    shapes_vary: bool = True,
) -> dict:
    """sdpa or math for `device`: measured forward + backward (training, with the model's attention
    `dropout` = (p, impl)) or forward alone (inference, `backward=False`) at the model's attention shape.
    On a GPU, where the rows change from batch to batch (`shapes_vary`: no bucketing), at row counts
    each candidate had not seen, and SDPA without cuDNN's kernel is a candidate too: cuDNN builds a plan
    per shape (an H200, bf16, headline shapes: 0.24x the baseline's speed with it)."""
    shape = shape or DEFAULT_ATTENTION
    margin = MIN_MATH_GAIN if backward else 1.0  # inference keeps nothing for backward: the quicker one
    answer = probe.attention(dtype, shape, backward=backward, dropout=dropout, bounds=(margin,))
    evidence = {"sdpa_s": answer["sdpa_s"], "math_s": answer["math_s"], "source": answer["source"]}
    if not answer["backends"]:
        return decided("math", f"no SDPA kernel runs on {device.type} in {dtype}: math", **evidence)
    new_shape = answer.get("new_shape_s") if shapes_vary else None
    costs = new_shape or {"math": answer["math_s"], "sdpa": answer["sdpa_s"]}
    if not new_shape and "sdpa_no_cudnn_s" in answer:
        costs["sdpa_no_cudnn"] = answer["sdpa_no_cudnn_s"]
    sdpa = min((c for c in costs if c != "math"), key=costs.__getitem__)  # the quicker SDPA
    ratio = costs[sdpa] / costs["math"]
    choice = "sdpa" if ratio <= margin else "math"
    timed = "forward+backward" if backward else "forward"
    if backward and dropout[0]:
        timed += f" with dropout {dropout[0]:g}"
    what = "SDPA" if sdpa == "sdpa" else "SDPA without cuDNN"
    where = "at a row count not run before" if new_shape else "at"
    reason = (
        f"{what} {timed} {ratio:.2f}x the math's time {where} {list(shape)} in "
        f"{str(dtype).removeprefix('torch.')} here: {choice}"
    )
    no_cudnn = choice == "sdpa" and sdpa != "sdpa"  # "here: math" needs no word on cuDNN
    if no_cudnn:
        reason += f" without cuDNN (with it {costs['sdpa'] / costs['math']:.2f}x)"
    if 1.0 < ratio <= margin:
        reason += f" (a near tie: the math keeps its probabilities and must be {MIN_MATH_GAIN:.2f}x quicker)"
    extra = {"sdpa_backends": answer["no_cudnn_backends"]} if no_cudnn else {}
    if new_shape:
        extra["new_shape_s"] = new_shape
    return decided(
        choice,
        reason + _load_note(answer),
        backends=answer["backends"],
        shape=list(shape),
        **evidence,
        **extra,
    )


def choose_checkpointing(dtype: str, attention: str, every: int) -> dict:
    """selective or none for activations kept in `dtype` (the run's precision, after precision=auto)
    by attention `attention` (after attention=auto): only fp32 with the written-out math keeps more."""
    if dtype == "fp32" and attention == "math":
        return decided(
            "selective",
            f"activations kept in fp32 (4 bytes each) with the written-out attention's [rows, heads, L, L] "
            f"probabilities: layers 0, {every}, {2 * every}, ... of each stack recomputed in backward "
            "(selective), so the step keeps no more than the baseline's",
            dtype=dtype,
            attention=attention,
        )
    if dtype == "fp32":
        reason = (
            "activations kept in fp32, attention by SDPA (no [rows, heads, L, L] kept): no layer recomputed"
        )
    else:
        reason = f"activations kept in {dtype} by autocast (half fp32's bytes): no layer recomputed"
    return decided("none", reason, dtype=dtype, attention=attention)


def resolve_auto(cfg: DictConfig, device: torch.device, micro_batch: int) -> dict[str, dict]:
    """Decide every probe-decided `auto` of `cfg` and write the choices into it; {group: decision}.
    The first rank measures alone (ranks measuring together would see each other's load) and every
    rank takes its decisions: they must all run the same phases."""
    if "auto" not in (cfg.precision.dtype, cfg.attention.impl, cfg.memory.checkpointing):
        return {}
    decisions = main_decides(lambda: measure_decisions(cfg, device, micro_batch))
    apply_decisions(cfg, decisions)
    return decisions


def measure_decisions(cfg: DictConfig, device: torch.device, micro_batch: int) -> dict[str, dict]:
    decisions: dict[str, dict] = {}
    probe = Probe(device, cfg.probe.cache, cfg.probe.refresh)
    matmuls, attention = model_shapes(cfg.model, micro_batch, cfg.data.max_asvs)
    if cfg.precision.dtype == "auto":
        torch.set_float32_matmul_precision(cfg.precision.matmul_precision)  # fp32 as the run would have it
        decisions["precision"] = choose_precision(device, probe, matmuls)
    dtype = decisions.get("precision", {}).get("chose", cfg.precision.dtype)
    if cfg.attention.impl == "auto":
        # the model's dropout on the attention weights, as the run will train (AAM's `model.dropout`)
        dropout = (float(cfg.model.get("dropout", 0.0)) if attention else 0.0, cfg.dropout.impl)
        decisions["attention"] = choose_attention(
            device, probe, DTYPES[dtype], attention, dropout=dropout, shapes_vary=not cfg.aam_ops.bucket
        )
    if cfg.memory.checkpointing == "auto":  # recorded beside the checkpointing phase
        attention = decisions.get("attention", {}).get("chose", cfg.attention.impl)
        decisions["checkpointing"] = choose_checkpointing(dtype, attention, cfg.memory.recompute_every)
    return decisions


def apply_decisions(cfg: DictConfig, decisions: dict[str, dict]) -> None:
    """Write the chosen values where `auto` stood: the phases then run as if they had been asked for."""
    if "precision" in decisions:
        cfg.precision.dtype = decisions["precision"]["chose"]
    if "attention" in decisions:
        cfg.attention.impl = decisions["attention"]["chose"]
        if "sdpa_backends" in decisions["attention"]:  # SDPA's kernels but cuDNN's
            cfg.attention.backends = decisions["attention"]["sdpa_backends"]
    if "checkpointing" in decisions:
        cfg.memory.checkpointing = decisions["checkpointing"]["chose"]
