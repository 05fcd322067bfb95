"""The probe's measurements, each timed here and now: matmul rates per dtype, SDPA against the written-out
attention, the import of torch's compiler and one block's compile, with the timing helpers they share
(trials in turn, rounds that stop once the answer is clear, the trials' spread). aamperf/probe.py asks
them and caches their answers."""

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from aamperf.errors import one_line
from aamperf.metrics.flops import (
    DTYPES,
    MAX_ROWS,
    MIN_WATCH_S,
    LoadWatch,
    square_shape,
    time_matmuls,
)

TRIALS = 7  # timed repeats of each measurement; its median is the figure
PAIRED_TRIALS = 3  # pairs of two calls timed in turn (the compile probe's eager and compiled block)
SETTLED = 4  # a low-precision matmul this many times slower than fp32 on a slice of rows: no more trials
# Attention's candidates: where PAIRED_TRIALS rounds' ratios all lie this far from each ratio at which the
# choice turns, on one side, no more rounds are timed. On a 2-core AVX2 EPYC the 7 rounds took 7.4-8.7 s
# of a first advanced run; the medians of 7 rounds at the headline's shape moved 0.92-1.13x between probes
# in one process (aamperf/phases/auto.py), about 1.1x either side of their middle.
CLEAR = 1.1


def low_precision_dtypes(device: torch.device) -> list[str]:
    """The autocast dtypes worth asking about (fp16 only on CUDA: its GradScaler is a GPU tool)."""
    if device.type == "cuda":
        return ["bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp16"]
    return ["bf16"]


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of `fn`, synchronized on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def timed(
    fn: Callable[[], Any], device: torch.device, trials: int = TRIALS, min_s: float = 0.0, warmup: bool = True
) -> list[float]:
    """Seconds of each call of `fn` (synchronized on a GPU), after one warm-up call unless `warmup=False`:
    `trials` calls, and more until they add up to `min_s` (a load watch needs a long enough window)."""
    if warmup:
        fn()
    times: list[float] = []
    while len(times) < trials or sum(times) < min_s:
        times.append(_seconds(fn, device))
    return times


def timed_in_turn(
    *fns: Callable[[], Any],
    device: torch.device,
    trials: int,
    min_s: float = 0.0,
    settled: Callable[[tuple[list[float], ...]], bool] | None = None,
) -> tuple[list[float], ...]:
    """Seconds of each call of warm functions called in turn: `trials` rounds, and more until each one's
    add up to `min_s`. A slow or quick spell of the machine falls on all of them alike, not on one, which
    matters for their ratios (what the compile and attention probes' readers use). `settled(times)`: a
    test after each round from the PAIRED_TRIALS-th on; true ends the rounds there (`min_s` still holds)."""
    times: tuple[list[float], ...] = tuple([] for _ in fns)
    while len(times[0]) < trials or min(map(sum, times)) < min_s:
        for fn, seconds in zip(fns, times, strict=True):
            seconds.append(_seconds(fn, device))
        rounds = len(times[0])
        if settled and PAIRED_TRIALS <= rounds < trials and min(map(sum, times)) >= min_s and settled(times):
            break
    return times


def beyond(bounds: Sequence[float], gap: float = CLEAR) -> Callable[[tuple[list[float], ...]], bool]:
    """A `settled` test for two functions timed in turn: every round's ratio (the second's time over the
    first's) `gap` x or more away from each of `bounds`, all on the same side of it. The bounds are where
    the reader's choice turns; rounds that clear all of them leave nothing for more rounds to decide."""

    def test(times: tuple[list[float], ...]) -> bool:
        ratios = [b / a for a, b in zip(*times, strict=True)]
        return all(
            all(r * gap <= bound for r in ratios) or all(r >= bound * gap for r in ratios) for bound in bounds
        )

    return test


def iqr_spread(values: list[float]) -> float:
    """Interquartile range / median: how far the middle half of the trials spread (one trial slowed by
    another process's burst does not make the median untrustworthy; a busy machine does). One value
    (a settled matmul): none."""
    if len(values) < 2:
        return 0.0
    q1, middle, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / middle if middle else 0.0


def measure_matmul(device: torch.device, shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """{dtype: median FLOP/s over the model's shapes} for fp32 and each low-precision dtype."""
    dtypes = ["fp32", *low_precision_dtypes(device)]
    if not shapes:  # a model whose shapes are not known (not AAM): a square one, sized for the device
        shapes = [square_shape(torch.get_num_threads()) if device.type == "cpu" else (4096, 4096, 4096)]
    record: dict[str, Any] = {"shapes": [list(s) for s in shapes], "flops": {}, "spread": {}, "settled": {}}
    if device.type == "cpu":
        # the model's shapes only (a square one if none given): an emulated bf16 runs a square at ~1
        # GFLOP/s, seconds a call, and the question is what the model's matmuls gain. A shape that runs
        # SETTLED x slower than fp32 on a slice of its rows is not timed further: 7 trials cannot lift it
        # to a gain (what it saves, measured by experiments/precision/settled_probe.py:
        # experiments/precision/README.md). Every dtype and shape in turn: their ratio is the answer.
        watch = LoadWatch()
        timed = time_matmuls(
            dtypes, [(min(m, MAX_ROWS), k, n) for m, k, n in shapes], TRIALS, settled_x=SETTLED
        )
        load = watch.stop()
        for dtype, model_shapes in timed.items():
            record["flops"][dtype] = statistics.median(s["median_flops"] for s in model_shapes)
            record["spread"][dtype] = max(iqr_spread(s["trials"]) for s in model_shapes)
            record["settled"][dtype] = all(s["settled"] for s in model_shapes)
        record["loadavg_before"] = load["loadavg_before"]
        record["under_load"] = LoadWatch.verdict(load)
        return record
    for dtype in dtypes:  # CUDA: the same shapes, timed with synchronization
        rates = []
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=DTYPES[dtype])
            b = torch.randn(k, n, device=device, dtype=DTYPES[dtype])
            times = timed(lambda a=a, b=b: a @ b, device)
            rates.append(statistics.median(2 * m * k * n / t for t in times))
        record["flops"][dtype] = statistics.median(rates)
    record["under_load"] = None
    return record


def measure_attention(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    backward: bool = True,
    dropout: tuple[float, str] = (0.0, "standard"),
    bounds: Sequence[float] = (),
) -> dict[str, Any]:
    """Which SDPA kernels run on `device` in `dtype`, and forward + backward seconds (forward alone with
    `backward=False`: inference) of SDPA (torch's choice of kernel) and of the written-out math on q, k,
    v of `shape` [N, heads, L, head_dim] with a key mask; in training with `dropout` = (p, the dropout
    phase's impl) on the attention weights, as the run would train them (on CPU SDPAttention then runs
    its chunked math: no CPU kernel has dropout). `bounds`: the ratios of SDPA's time to the math's at
    which the reader's choice turns; rounds that all clear them by CLEAR end the timing early."""
    from omegaconf import OmegaConf
    from torch.nn.attention import sdpa_kernel

    from aamperf.model.layers import MathAttention
    from aamperf.phases.attention import BACKENDS, SDPAttention
    from aamperf.phases.dropout import apply_dropout

    gen = torch.Generator().manual_seed(0)
    n, heads, length, head_dim = shape
    q, k, v = (
        torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_() for _ in range(3)
    )
    mask = (torch.rand(n, 1, 1, length, generator=gen) < 0.8).to(device)
    mask[..., 0] = True
    runs = []
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=mask[:1])
            runs.append(name)
        except RuntimeError:
            pass

    def step(module: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            if not backward:
                with torch.no_grad():
                    module(q, k, v, mask)
                return
            module(q, k, v, mask).sum().backward()
            q.grad = k.grad = v.grad = None

        return run

    p = dropout[0] if backward else 0.0
    modules = nn.ModuleList([MathAttention(p), SDPAttention(p, [])])
    # cuDNN's kernel builds a plan per new shape: where it runs, SDPA without it is a third candidate
    fused = [b for b in BACKENDS if b in runs and b not in ("cudnn", "math")]
    if device.type == "cuda" and "cudnn" in runs and fused:
        modules.append(SDPAttention(p, [*fused, "math"]))
    apply_dropout(modules, OmegaConf.create({"impl": dropout[1]}), device)
    watch = LoadWatch()
    calls = [step(module) for module in modules]
    for call in calls:
        call()  # warm: a first call's allocations and kernel choices are not a step's
    # in turn: timed one after the other, a near tie chose SDPA in one run and the math in the next
    # (the default job's shape: 0.98x, 1.06x and 1.21x on one 2-core AVX-512 EPYC, 2026-11-28)
    # two candidates clearly apart on one side of every bound need no more than PAIRED_TRIALS rounds
    settled = beyond(bounds) if bounds and len(calls) == 2 else None
    math_s, sdpa_s, *rest = timed_in_turn(
        *calls, device=device, trials=TRIALS, min_s=MIN_WATCH_S / 2, settled=settled
    )
    extra: dict[str, Any] = {}
    if rest:
        extra = {"sdpa_no_cudnn_s": statistics.median(rest[0]), "no_cudnn_backends": [*fused, "math"]}
    if device.type == "cuda":
        # AAM's ASV rows change from batch to batch unless bucketed: a call at a row count not seen
        # before, each candidate after its warm calls above (the allocator's blocks are large enough)
        names = ["math", "sdpa", "sdpa_no_cudnn"][: len(modules)]
        extra["new_shape_s"] = {
            name: statistics.median(new_shape_calls(module, q, k, v, mask, backward))
            for name, module in zip(names, modules, strict=True)
        }
    load = watch.stop()
    spread = max(iqr_spread(math_s), iqr_spread(sdpa_s))
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "backward": backward,
        "dropout_p": p,
        "backends": runs,
        "math_s": statistics.median(math_s),
        "sdpa_s": statistics.median(sdpa_s),
        "rounds": len(math_s),
        **extra,
        "spread": spread,
        **load,
        "under_load": LoadWatch.verdict(load) if device.type == "cpu" else None,
    }


NEW_SHAPES = 3  # row counts a candidate has not seen, one call each: the median of their seconds


def new_shape_calls(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, backward: bool
) -> list[float]:
    """Seconds of one synchronized call of `module` at each of NEW_SHAPES row counts below q's, each a
    shape it has not run (a row count changes the kernels' problem size, as a new batch's does)."""
    times = []
    for rows in range(q.shape[0] - 1, q.shape[0] - 1 - NEW_SHAPES, -1):
        torch.cuda.synchronize(q.device)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = module(q[:rows], k[:rows], v[:rows], mask[:rows])
        if backward:
            out.sum().backward()
            q.grad = k.grad = v.grad = None
        torch.cuda.synchronize(q.device)
        times.append(time.perf_counter() - start)
    return times


SMALL_BLOCK = (4, 16, 32, 2, 4)  # [rows, length, dim], heads, ffn_mult: a block for a model that says none


COMPILER = "torch._inductor.compile_fx"  # what torch.compile(backend="inductor") imports, dynamo with it


def compiler_imported() -> bool:
    """Has this process imported torch's compiler (dynamo and inductor) already?"""
    return COMPILER in sys.modules


def measure_compiler_import() -> dict[str, Any]:
    """Seconds this process takes to import dynamo and inductor, which any torch.compile loads first:
    the least compiling costs a process here (1.8-2.3 s in runs, 3.3-4.7 s in
    experiments/compile/cold_compile.py --trivial, 2-core AVX2 EPYC; a two-op compile then takes 10-11 s
    more). Measured only where not imported yet."""
    watch = LoadWatch()
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    import_s = time.perf_counter() - start
    load = watch.stop()
    return {"import_s": import_s, **load, "under_load": LoadWatch.verdict(load, use_loadavg=False)}


def measure_compile(
    device: torch.device,
    block: tuple[int, int, int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Whether torch.compile (inductor) works here; the seconds it takes to compile forward and backward
    of one transformer block (aamperf's `Block`) of `block` = (rows, length, dim, heads, ffn_mult); and
    its forward + backward time eager and compiled there, under autocast to `dtype`: what compiling
    one block costs and gains on this device."""
    # dynamo imported whole before the try: a stop signal in its first import (seconds on a slow CPU)
    # left it half made, and the `finally` reset below failed in place of the stop (AVX2-only EPYC)
    import torch._dynamo

    from aamperf.model.layers import Block

    rows, length, dim, heads, ffn_mult = block or SMALL_BLOCK
    module = Block(dim, heads, ffn_mult, 0.0).to(device)
    x = torch.randn(rows, length, dim, device=device, requires_grad=True)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            with autocast:
                y = fn(x, None)
            y.float().sum().backward()
            x.grad = None
            module.zero_grad(set_to_none=True)

        return run

    step(module)()  # eager warm-up
    try:
        compiled = torch.compile(module)
        start = time.perf_counter()
        step(compiled)()
        compile_s = time.perf_counter() - start
        # in turn, after the compile (which runs the C++ compiler in other processes), watched: at the
        # headline's width on a 2-core AVX2 EPYC, TRIALS of each timed apart took 22-28 s of the probe's
        # 49-55 s (experiments/compile/cold_compile.py --probe)
        watch = LoadWatch()
        eager_s, compiled_s = timed_in_turn(
            step(module), step(compiled), device=device, trials=PAIRED_TRIALS, min_s=MIN_WATCH_S / 2
        )
    except Exception as exc:  # a missing C compiler, an unsupported device: compile does not work here
        error = one_line(f"{type(exc).__name__}: {exc}")[:300]
        return {"works": False, "error": error, "under_load": None}
    finally:
        torch._dynamo.reset()  # the probe's graphs must not count as the run's compiles
    load = watch.stop()
    spread = max(iqr_spread(eager_s), iqr_spread(compiled_s))  # recorded; millisecond steps spread
    return {
        "works": True,
        "error": None,
        "block": [rows, length, dim, heads, ffn_mult],
        "dtype": str(dtype).removeprefix("torch."),
        "block_compile_s": compile_s,
        "eager_block_s": statistics.median(eager_s),
        "compiled_block_s": statistics.median(compiled_s),
        "spread": spread,
        **load,
        # only other processes' load makes it untrustworthy: a noisy answer that is re-measured by every
        # run would cost each run a compile, which is what the cache is for
        "under_load": LoadWatch.verdict(load, use_loadavg=False) if device.type == "cpu" else None,
    }
