"""Inference levels: the training phases that apply to a forward pass (precision, attention, aam_ops,
compile, each with `auto` where the device decides) plus `quantize`, applied in a fixed order to the
loaded model; and the quality check of a level against the fp32 eager model on the same samples."""

import hashlib
import json
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from aamperf.distributed import World, main_decides
from aamperf.model.loss import predicted_unifrac
from aamperf.phases.aam_ops import apply_aam_ops
from aamperf.phases.attention import apply_attention
from aamperf.phases.auto import apply_decisions, choose_attention, choose_precision
from aamperf.phases.compile import apply_compile, auto_compile, cached_decision, compile_on_ranks
from aamperf.phases.precision import DTYPES, apply_precision, apply_residual
from aamperf.phases.record import applied, skipped
from aamperf.predict.target import SavedTarget, in_own_units, probabilities
from aamperf.probe import Probe, compile_block, model_shapes


def apply_levels(
    model: nn.Module,
    cfg: DictConfig,
    device: torch.device,
    model_cfg: Any,
    batch: dict[str, Any],
    calls: int,
    world: World,
) -> tuple[Callable, dict[str, dict]]:
    """(autocast factory, {group: record}); `batch`, a real one on the device: compile's warm-up and
    trial; `calls`: the forward passes the run will make (compile=auto compiles where they repay it).
    Under torchrun the first rank measures alone and every rank applies its decisions, as in training:
    the ranks' shares are predicted by one level."""
    records: dict[str, dict] = {}
    decisions = main_decides(lambda: decide_auto(cfg, device, model_cfg, batch))
    apply_decisions(cfg, decisions)
    autocast, _, records["precision"] = apply_precision(cfg.precision, device)
    records["precision"].update(apply_residual(model, cfg.precision))
    records["attention"] = apply_attention(model, cfg.attention)
    records["aam_ops"] = apply_aam_ops(model, cfg.aam_ops)
    records["quantize"] = apply_quantize(model, cfg.quantize.mode, autocast)
    warmup = lambda: forward(model, batch, autocast)  # noqa: E731 - compile's warm-up, the trial's one batch
    if cfg.compile.mode == "auto":  # training's decision, with a forward pass for a step
        step = lambda i: warmup()  # noqa: E731
        context = compile_context(cfg, model_cfg, batch)

        def probe() -> Probe:
            return Probe(device, cfg.probe.cache, cfg.probe.refresh)

        def decide() -> dict:
            block = compile_block(model_cfg, len(batch["tokens"]), batch["tokens"].shape[1])
            dtype = DTYPES.get(cfg.precision.dtype, torch.float32)
            return auto_compile(model, cfg.compile, step, 1, calls, probe(), context, block, dtype)

        def known() -> dict | None:
            return cached_decision(probe(), context, calls)

        records["compile"] = compile_on_ranks(model, cfg.compile, step, world, known, decide)
    else:
        records["compile"] = apply_compile(model, cfg.compile, warmup)
    for group, decision in decisions.items():  # each `auto` beside what its phase then did
        records[group]["auto"] = decision
    return autocast, records


def compile_context(cfg: DictConfig, model_cfg: Any, batch: dict[str, Any]) -> str:
    """What an inference compile trial's figures depend on besides the device: the model, the level,
    the batch shape."""
    groups = ("precision", "attention", "aam_ops", "quantize", "compile")
    nodes = {g: OmegaConf.to_container(cfg[g], resolve=True, enum_to_str=True) for g in groups}
    nodes.update(model=OmegaConf.to_container(model_cfg), inference=True, batch=list(batch["tokens"].shape))
    return hashlib.sha1(json.dumps(nodes, sort_keys=True, default=str).encode()).hexdigest()[:16]


def decide_auto(
    cfg: DictConfig, device: torch.device, model_cfg: Any, batch: dict[str, Any]
) -> dict[str, dict]:
    """precision=auto and attention=auto from the device probe, at the model's shapes for `batch` (a
    real one: its samples and its width, as the run's batches are padded)."""
    if "auto" not in (cfg.precision.dtype, cfg.attention.impl):
        return {}
    probe = Probe(device, cfg.probe.cache, cfg.probe.refresh)
    samples, width = batch["tokens"].shape[:2]
    matmuls, attention = model_shapes(model_cfg, samples, width)
    decisions = {}
    if cfg.precision.dtype == "auto":
        decisions["precision"] = choose_precision(device, probe, matmuls)
    dtype = decisions.get("precision", {}).get("chose", cfg.precision.dtype)
    if cfg.attention.impl == "auto":  # measured on a forward pass alone: what inference runs
        decisions["attention"] = choose_attention(
            device, probe, DTYPES[dtype], attention, backward=False, shapes_vary=not cfg.aam_ops.bucket
        )
    apply_decisions(cfg, decisions)
    return decisions


def apply_quantize(model: nn.Module, mode: str, autocast: Callable) -> dict:
    """int8_dynamic: every nn.Linear's weights stored in int8, activations quantized per batch at run
    time (torch.ao.quantization.quantize_dynamic, the x86 / fbgemm kernels: it runs on any x86 CPU;
    torchao, its successor, is not a dependency here). In place, CPU only, fp32 only."""
    if mode == "none":
        return skipped("quantize=none")
    if next(model.parameters()).device.type != "cpu":
        return skipped("quantize=int8_dynamic runs on CPU only: left in float", mode=mode)
    if autocast is not nullcontext:
        return skipped("quantize=int8_dynamic with an autocast precision: left in float (precision=fp32)")
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # "torch.ao.quantization is deprecated": still the one that runs here
        warnings.simplefilter("ignore")
        linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return applied(mode=mode, linear_layers=linears, engine=torch.backends.quantized.engine)


def quality(
    reference: dict[str, torch.Tensor],
    level: dict[str, torch.Tensor],
    target: SavedTarget | None,
    units: torch.Tensor | None = None,
) -> dict:
    """A level's outputs against the fp32 eager model's on the same samples: cosine similarity of the
    sample embeddings (mean, worst), the predicted UniFrac's mean absolute difference (over every pair),
    and the target's: a regression's mean absolute difference in its own units (`target_mae`) and in the
    model's (`target_mae_scale`: in target standard deviations for a zscore), a classification's largest
    difference of a class probability (`target_probability_max_diff`). `units`: each sample's
    zscore_category shift and scale (aamperf/predict/target.py's `sample_units`)."""
    mine, theirs = level["embedding"].double(), reference["embedding"].double()
    cosine = torch.nn.functional.cosine_similarity(mine, theirs, dim=1)
    result = {
        "samples": len(mine),
        "embedding_cosine_mean": cosine.mean().item(),
        "embedding_cosine_min": cosine.min().item(),
        "unifrac_mae": (predicted_unifrac(mine.float()) - predicted_unifrac(theirs.float()))
        .abs()
        .mean()
        .item(),
    }
    if target is None or not (len(level["predicted"]) and len(reference["predicted"])):
        return result  # no target learnt (a pretraining): its head's output means nothing
    if target.spec.is_classification:
        diff = probabilities(level["predicted"]) - probabilities(reference["predicted"])
        result["target_probability_max_diff"] = diff.abs().max().item()
        return result
    own = in_own_units(target, level["predicted"], units) - in_own_units(
        target, reference["predicted"], units
    )
    result["target_mae"] = own.abs().mean().item()
    in_model_units = level["predicted"].double() - reference["predicted"].double()
    result["target_mae_scale"] = in_model_units.abs().mean().item()
    return result


def forward(model: nn.Module, batch: dict[str, Any], autocast: Callable) -> dict[str, torch.Tensor]:
    with torch.inference_mode(), autocast():
        # the samples' categories only where the batch has them (a model conditioned on data.categorical)
        conditions = {"categorical": batch["categorical"]} if "categorical" in batch else {}
        return model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], **conditions)
