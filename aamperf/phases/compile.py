"""torch.compile of the model (or of each transformer block), with a recorded fallback to eager.

compile=auto compiles only where it pays for itself on this device, this model and these batches:
the steady gain per step, times the run's steps, must exceed the compile time, both measured here by
timing real steps eager and compiled (a trial, cached by device, model, phases and batch shape). A trial
that cannot pay is not run: the device probe compiles one transformer block of the model's shape and
times it eager and compiled; the gain per step is at most the eager step times the share the compiled
block saved, and compiling costs at least the probe's time for that one block: the model's other blocks
reuse its graph where their shapes match and recompile it where they do not
(`experiments/compile/block_reuse.py`, `dynamic=True`, a new inductor cache, 2-core AVX-512 EPYC: the
first headline-width block 23.3 s, a second of the same shapes 0.3 s, one of another stack's shapes
5.0 s, its twin 0.0 s; counting every block as a first one overstated the cost about 3x). Where the gain
bound exceeds that least cost, the trial decides on the model's own compile time.

Before any block is probed, a run too short for any compile to pay is told apart for less: on a device
that has compiled nothing, where the step's FLOPs at the device's peak (a hint of its least time: it
decides only whether a step is timed) over the run's steps are below importing torch's compiler
(measured once per device: 1.8-4.7 s on a 2-core AVX2 EPYC, against 25-41 s for the block probe), one
eager step is timed; if every step together takes no longer than that import, compiling cannot pay.
"""

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from aamperf.distributed import World, alone, every_rank, main_decides
from aamperf.errors import one_line
from aamperf.metrics.flops import MIN_WATCH_S, LoadWatch
from aamperf.model.layers import Block
from aamperf.phases.record import applied, fallback, skipped
from aamperf.probe import Probe
from aamperf.probe_measures import compiler_imported, timed
from aamperf.rng import forked_rng

log = logging.getLogger(__name__)

TRIAL_PASSES = 1  # timed passes over the trial batches, eager and compiled, after one that warms up


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles for new shapes included)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# modes that replay CUDA graphs on a GPU (on a CPU they compile as `default` does)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(model: nn.Module, cfg: DictConfig) -> bool:
    return cfg.mode in CUDA_GRAPH_MODES and next(model.parameters()).device.type == "cuda"


def _targets(model: nn.Module, cfg: DictConfig) -> list[nn.Module]:
    # Per block: AAM's ASV gathering (nonzero / unique) would break one whole-model graph into pieces;
    # the blocks hold almost all the FLOPs and have no data-dependent ops. Not with CUDA graphs: the
    # blocks of one shape share one compiled graph, and replaying it for the next block overwrites the
    # activations the previous block's backward needs (seen on an H200: "accessing tensor output of
    # CUDAGraphs that has been overwritten by a subsequent run"); the whole model's pieces are distinct.
    # A block that memory= recomputes is compiled with its checkpoint wrapper, so dynamo traces the
    # recomputation into the block's graph. Compiled inside the wrapper, its forward and the recompute
    # in backward could run different graphs: on an H100 the recomputation saved other tensors than the
    # forward ("Recomputed values ... have different metadata than during the forward pass"; likely a
    # static graph for a block's first shapes and a dynamic one for the next block's, which matches
    # both, looked up first). It costs compile time where only some blocks recompute (memory=selective):
    # those and the others are separate graphs (experiments/compile/cold_compile.py: aam_tiny with 2
    # layers a stack, dynamic, 2-core AVX2 EPYC: 4 graphs in 103 / 109 s against 2 in 54 / 58 s);
    # compile=auto's trial times the model's own compile, so it still decides.
    wrappers = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)
    }
    blocks = [wrappers.get(id(m), m) for m in model.modules() if isinstance(m, Block)]
    per_block = cfg.per_block and blocks and not uses_cuda_graphs(model, cfg)
    return blocks if per_block else [model]


def _to_eager(targets: list[nn.Module]) -> None:
    for module in targets:
        module._compiled_call_impl = None  # the slot nn.Module.compile() fills: emptied, eager again
    torch._dynamo.reset()


def apply_compile(model: nn.Module, cfg: DictConfig, warmup: Callable[[], None]) -> dict:
    """Compile in place (state_dict keys unchanged), then run `warmup` (one forward + backward) so that
    compilation happens here, timed apart from the training steps. Any failure -> eager, recorded."""
    if cfg.mode == "disabled":
        return skipped("compile=disabled")
    targets = _targets(model, cfg)
    mode = None if cfg.mode in ("default", "auto") else cfg.mode
    if next(model.parameters()).device.type == "cuda":
        # inductor pads the strides of buffers it lays out (to 128 bytes) and asserts that a fallback
        # kernel's output has them: an H200 run failed so, "stride 45602==45632" (a [55, 2, 151, 151]
        # fp32 buffer): its padding is off for our compiled graphs
        torch._inductor.config.comprehensive_padding = False
    start, graphs = time.perf_counter(), compiled_graphs()
    try:
        run_eagerly_in_graphs(model)
        for module in targets:
            module.compile(mode=mode, backend=cfg.backend, dynamic=cfg.dynamic, fullgraph=cfg.fullgraph)
        warmup()
    except Exception as exc:  # a backend that is missing or fails on this model: train eagerly instead
        _to_eager(targets)
        reason = f"torch.compile failed, running eager: {one_line(f'{type(exc).__name__}: {exc}')[:300]}"
        log.warning(f"compile={cfg.mode} compile.backend={cfg.backend}: {reason}")
        return fallback(reason, mode=cfg.mode, backend=cfg.backend)
    return applied(
        mode=cfg.mode,
        backend=cfg.backend,
        per_block=targets[0] is not model,
        cuda_graphs=uses_cuda_graphs(model, cfg),
        modules=len(targets),
        compile_time_s=time.perf_counter() - start,
        graphs=compiled_graphs() - graphs,
    )


def run_eagerly_in_graphs(model: nn.Module) -> None:
    """The methods each module class of `model` names in its EAGER_IN_GRAPHS run eagerly between the
    compiled graphs (`torch.compiler.disable`, on the class, once): Python that compiles badly, e.g. the
    CPU's chunked dropout attention (aamperf/phases/attention.py). Here, not where they are defined, so
    that a run that never compiles never imports torch's compiler (1-2 s)."""
    for cls in {type(m) for m in model.modules()}:
        for name in getattr(cls, "EAGER_IN_GRAPHS", ()):
            method = getattr(cls, name)
            if not getattr(method, "_torchdynamo_disable", False):  # torch's mark of a disabled function
                setattr(cls, name, torch.compiler.disable(method))


def compile_trial(model: nn.Module, cfg: DictConfig, step: Callable[[int], None], batches: int) -> dict:
    """Time a pass of `step` over the trial batches eager, then compile and time it again; the model is
    left compiled. {eager_step_s, compiled_step_s, compile_s, graphs, under_load}."""
    device = next(model.parameters()).device

    def one_pass() -> None:
        for i in range(batches):
            step(i)

    watch = LoadWatch()  # over the timed passes only: compiling runs the C++ compiler in other processes
    eager_s = statistics.median(timed(one_pass, device, trials=TRIAL_PASSES)) / batches  # after a warm-up
    watch.pause()
    start, graphs = time.perf_counter(), compiled_graphs()
    record = apply_compile(model, cfg, lambda: step(0))
    if record["status"] != "applied":
        return {"error": record["reason"], "under_load": None}
    one_pass()  # compiles the graphs of the other trial batches' shapes
    watch.resume()
    compiled_s = statistics.median(timed(one_pass, device, trials=TRIAL_PASSES, warmup=False)) / batches
    load = watch.stop()
    return {
        "eager_step_s": eager_s,
        "compiled_step_s": compiled_s,
        "compile_s": time.perf_counter() - start - batches * compiled_s * (1 + TRIAL_PASSES),
        "graphs": compiled_graphs() - graphs,
        "batches": batches,
        "under_load": LoadWatch.verdict(load) if device.type == "cpu" else None,
        **load,
    }


def eager_step(step: Callable[[int], None], device: torch.device) -> dict:
    """Seconds of a warm forward + backward of trial batch 0, eager (the median of the steps that fill
    a load watch's window; one where a step is longer), with the load beside it."""
    watch = LoadWatch()
    eager_s = statistics.median(timed(lambda: step(0), device, trials=1, min_s=MIN_WATCH_S))
    load = watch.stop()
    verdict = LoadWatch.verdict(load, use_loadavg=False) if device.type == "cpu" else None
    return {"eager_step_s": eager_s, **load, "under_load": verdict}


def trial_context(cfg: DictConfig, micro_batch: int) -> str:
    """What a compile trial's figures depend on besides the device: the model, the phases that change
    its graph, the batch shape."""
    groups = ("model", "precision", "attention", "dropout", "memory", "aam_ops", "compile")
    nodes = {g: OmegaConf.to_container(cfg[g], resolve=True, enum_to_str=True) for g in groups}
    nodes["batch"] = [micro_batch, cfg.data.max_asvs, cfg.data.get("n_asvs"), cfg.data.get("mean_richness")]
    return hashlib.sha1(json.dumps(nodes, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pays(figures: dict[str, Any], steps: int, compiled_already: bool = False) -> tuple[bool, str]:
    """Does compiling pay over `steps` training steps, given a trial's figures? Once the trial has
    compiled the model, its compile time is spent: compiled steps only have to be faster."""
    gain_s = (figures["eager_step_s"] - figures["compiled_step_s"]) * steps
    cost_s = 0.0 if compiled_already else figures["compile_s"]
    verdict = gain_s > cost_s
    why = (
        f"compiled step {figures['compiled_step_s'] / figures['eager_step_s']:.2f}x the eager one "
        f"({figures['compiled_step_s']:.3g} s vs {figures['eager_step_s']:.3g} s): {gain_s:.1f} s saved over "
        f"{steps} steps {'>' if verdict else '<='} "
        + ("0 (compiled already in the trial)" if compiled_already else f"{cost_s:.1f} s of compiling")
        + f": {'compiled' if verdict else 'eager'}"
    )
    return verdict, why


def cached_decision(probe: Probe, context: str, steps: int) -> dict | None:
    """compile=auto's decision (its `auto` record) from the figures of an earlier trial here, found
    without compiling anything; None where no trial of this context is cached."""
    cached = probe.cached("compile_trial", {"context": context})
    if cached is None:
        return None
    if "error" in cached:
        return {"chose": "disabled", "reason": f"an earlier trial here failed ({cached['error']})"}
    compile_it, why = pays(cached, steps)
    return {"chose": "default" if compile_it else "disabled", "reason": why, "source": "cache", **cached}


def as_decided(model: nn.Module, cfg: DictConfig, step: Callable[[int], None], auto: dict) -> dict:
    """The compile phase's record for a known compile=auto decision: compiled (warm-up `step(0)`) or
    eager."""
    if auto["chose"] == "default":
        return {**apply_compile(model, cfg, lambda: step(0)), "auto": auto}
    return skipped(f"compile=auto: {auto['reason']}", auto=auto)


def compile_on_ranks(
    model: nn.Module,
    cfg: DictConfig,
    step: Callable[[int], None],
    world: World,
    known: Callable[[], dict | None],
    decide: Callable[[], dict],
) -> dict:
    """compile=auto with every rank doing as the first decides. The first rank looks for a cached
    decision (`known()`), said before anyone compiles so that every rank then compiles at once; else it
    runs `decide()` (probes, trial) while the others wait, and they compile after it where it chose to.
    Every rank's steps run `alone()`: a collective of the loss would wait for ranks that wait for the
    decision; the waits last as long as the work does (`main_decides`, `every_rank`), not
    distributed.timeout_s."""

    def on_first_rank() -> tuple[dict | None, dict | None]:  # (a cached decision, or the trial's record)
        decision = known()
        if decision is not None:
            return decision, None
        with alone():
            return None, decide()

    decision, record = main_decides(on_first_rank)

    def on_this_rank() -> dict:
        with alone():
            if decision is not None:
                return as_decided(model, cfg, step, decision)
            if not world.is_main and record.get("auto", {}).get("chose") == "default":
                return {**apply_compile(model, cfg, lambda: step(0)), "auto": record["auto"]}
            return record

    return every_rank(on_this_rank)


def auto_compile(
    model: nn.Module,
    cfg: DictConfig,
    step: Callable[[int], None],
    batches: int,
    steps: int,
    probe: Probe,
    context: str,
    block: tuple[int, int, int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    least_step_s: float | None = None,
) -> dict:
    """compile=auto: compile `model` only if it pays over `steps`; `step(i)` runs forward + backward of
    trial batch i (< `batches`); `block` and `dtype`: the model's block shape and autocast dtype, for the
    device probe; `least_step_s`: a step's FLOPs at the device's peak, where known (whether a step is
    worth timing against the compiler's import).
    The record's `auto` holds the decision, its reason and the figures."""

    def eager(reason: str, **figures: Any) -> dict:
        return skipped(f"compile=auto: {reason}", auto={"chose": "disabled", "reason": reason, **figures})

    known = cached_decision(probe, context, steps)
    if known is not None:  # an earlier trial here decides, without one
        return as_decided(model, cfg, step, known)
    params = {"context": context}
    start = time.perf_counter()  # the probes' time counts: a first run here pays them

    def timed_eager_step() -> float:  # one warm step of the first batch, once per device, model and batch
        return probe.answer("eager_step", params, lambda: eager_step(step, probe.device))["eager_step_s"]

    with forked_rng(probe.device):  # the trial's dropout draws leave the run's stream as it was
        # any block compiled here before: a floor that can spare this block's probe, unless that probe is
        # cached (it then decides for nothing, and a compiled block no faster needs no eager step timed)
        probed = probe.cached("compile", {"block": block, "dtype": dtype}) is not None
        floor_s = None if probed else probe.least("compile", "block_compile_s")
        floor_what = "the quickest block compile measured on this device"
        if floor_s is None and not probed and least_step_s is not None and not compiler_imported():
            # nothing compiled here yet: importing the compiler is the least a compile costs; a step is
            # timed only where the steps' FLOPs at the peak leave room for the import to outweigh them
            import_s = probe.compiler_import()["import_s"]
            if least_step_s * steps < import_s:
                floor_s, floor_what = import_s, "importing torch's compiler, measured here"
        if floor_s is not None and (eager_s := timed_eager_step()) * steps <= floor_s:
            reason = (
                f"{steps} steps of {eager_s:.3g} s take {eager_s * steps:.1f} s in all, no more than "
                f"compiling costs here (at least {floor_s:.1f} s: {floor_what}): compiling cannot pay"
            )
            return eager(reason, trial_s=time.perf_counter() - start, eager_step_s=eager_s)
        works = probe.compile(block, dtype)
        if not works["works"]:
            return eager(f"torch.compile does not work here ({works['error']})")
        ratio = works["compiled_block_s"] / works["eager_block_s"]
        eager_s = timed_eager_step() if ratio < 1.0 else float("nan")  # no step timed: 0 x any step
        bound_s = eager_s * (1.0 - ratio) * steps if ratio < 1.0 else 0.0
        cost_s = works["block_compile_s"]  # at least: the first block's graph (the docstring's figures)
        if bound_s <= cost_s:
            probed = (
                f"a compiled block ran {ratio:.2f}x its eager time here (device probe: {works['block']} in "
            )
            gain = (
                f"{steps} steps of {eager_s:.3g} s can gain at most {bound_s:.1f} s; compiling costs at "
                f"least {cost_s:.1f} s (one block's graph)"
                if ratio < 1.0
                else "compiling cannot pay"
            )
            step_figure = {"eager_step_s": eager_s} if ratio < 1.0 else {}  # the loader's decision reuses it
            trial_s = time.perf_counter() - start
            return eager(f"{probed}{works['dtype']}): {gain}", trial_s=trial_s, **step_figure)
        figures = probe.answer("compile_trial", params, lambda: compile_trial(model, cfg, step, batches))
    trial_s = time.perf_counter() - start
    if "error" in figures:
        return fallback(f"compile=auto: the trial failed ({figures['error']}): eager", trial_s=trial_s)
    compile_it, why = pays(figures, steps, compiled_already=True)
    auto = {"chose": "default" if compile_it else "disabled", "reason": why, "trial_s": trial_s, **figures}
    if compile_it:
        return applied(
            mode="default", backend=cfg.backend, compile_time_s=trial_s, graphs=figures["graphs"], auto=auto
        )
    _to_eager(_targets(model, cfg))
    return skipped(f"compile=auto: {why}", auto=auto)  # its trial_s: time spent deciding, no compile kept
