"""What each device-dependent choice costs on this device, measured once and kept: the evidence `auto` reads.

Three questions, each answered by a measurement, never by a CPU model name:
- `matmul`: FLOP/s per dtype at the model's own matmul shapes (median of several trials, the load
  recorded beside it): does a bf16 (fp16) autocast pay here?
- `attention`: which SDPA kernels run here, and forward + backward time of SDPA against the written-out
  math at the model's attention shape (on a GPU also at row counts not run before, and of SDPA without
  cuDNN's kernel, which builds a plan per shape).
- `compile`: does torch.compile work here, and how long does compiling one transformer block take?
  Before it, on a device that has compiled nothing: how long importing torch's compiler takes
  (`compiler_import`), the least any compile costs a process.

The measurements and the timing helpers they share: aamperf/probe_measures.py.

Answers are cached per device (machine, CPU flags or GPU name, torch, threads) and question shape in
`probe.cache`; one measured while other processes used the CPU is used but never cached, and
`probe.refresh=true` measures again. The trials' spread is recorded beside each answer but does not
keep it out of the cache: some measurements vary by themselves (written-out attention allocates tens of
MB a call), and one a run re-measures each time would cost each run its seconds.
"""

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aamperf.files import read_json_cache, update_json_cache
from aamperf.interrupts import stop_if_signalled
from aamperf.metrics.flops import MAX_ROWS
from aamperf.metrics.host import machine_key
from aamperf.probe_measures import (
    NEW_SHAPES,
    measure_attention,
    measure_compile,
    measure_compiler_import,
    measure_matmul,
)
from aamperf.rng import forked_rng

log = logging.getLogger(__name__)

# What each question measures, for the line a run shows while it waits on a first measurement
MEASURES = {
    "matmul": "matmul rates per dtype at the model's shapes (precision=auto)",
    "attention": "SDPA against the written-out attention (attention=auto)",
    "compiler_import": "the import of torch's compiler (compile=auto)",
    "compile": "the compile of one transformer block (compile=auto)",
    "eager_step": "one eager training step (compile=auto)",
    "compile_trial": "eager and compiled steps of this model on its batches (compile=auto)",
    "precision_trial": "training steps of this model under each dtype (precision=auto on a GPU)",
    "loader_step": "one training step of this model, to weigh making a batch against (dataloader=auto)",
    "loader_trial": "steps with and without a loader worker (dataloader=auto)",
}

STAMP = "%Y-%m-%dT%H:%M:%S"  # a measurement's time, as the cache keeps it


def device_key(device: torch.device) -> str:
    """This device as the cache knows it: a CPU by machine, model, matmul flags, threads and torch; a GPU
    by name and CUDA version."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}|cuda={torch.version.cuda}|torch={torch.__version__}"
    return machine_key("", torch.get_num_threads()).rstrip("|")


def measuring(question: str, cache_file: Path) -> float:
    """Say what is measured, before a wait of up to tens of seconds a first run on a device pays."""
    what = MEASURES.get(question, question)
    log.info("measuring %s on this device (once: kept in %s for the next runs)", what, cache_file)
    return time.perf_counter()


def measured(question: str, started: float) -> None:
    log.info("measured %s: %.1f s", MEASURES.get(question, question), time.perf_counter() - started)


def compile_block(model_cfg: Any, micro_batch: int, max_asvs: int) -> tuple[int, int, int, int, int] | None:
    """The ASV encoder's block at this batch (rows capped as in `model_shapes`), for the compile probe."""
    _, attention = model_shapes(model_cfg, micro_batch, max_asvs)
    if attention is None:
        return None
    rows, heads, length, head_dim = attention
    return rows, length, heads * head_dim, heads, int(model_cfg.ffn_mult)


class Probe:
    """The answers for one device, measured on first use and cached in `cache_file`."""

    def __init__(self, device: torch.device, cache_file: str | Path, refresh: bool = False):
        self.device, self.cache_file, self.refresh = device, Path(cache_file), refresh
        self.key = device_key(device)

    def _key(self, question: str, params: dict[str, Any]) -> str:
        return f"{self.key}|{question}|" + ",".join(f"{k}={v}" for k, v in sorted(params.items()))

    def cached(self, question: str, params: dict[str, Any]) -> dict | None:
        """The cached answer, or None (none yet, or probe.refresh asks for a new one)."""
        if self.refresh:
            return None
        return read_json_cache(self.cache_file).get(self._key(question, params))

    def least(self, question: str, figure: str) -> float | None:
        """The smallest `figure` among the cached answers to `question` on this device, whatever their
        parameters (e.g. the quickest block compile measured here), or None."""
        if self.refresh:
            return None
        prefix = f"{self.key}|{question}|"
        cache = read_json_cache(self.cache_file)
        figures = [r[figure] for k, r in cache.items() if k.startswith(prefix) and r.get(figure) is not None]
        return min(figures, default=None)

    def answer(self, question: str, params: dict[str, Any], measure: Callable[[], dict]) -> dict:
        """The cached answer to `question` with these `params` on this device, or a new measurement (cached
        when the machine was quiet; otherwise a quiet earlier one is preferred)."""
        key = self._key(question, params)
        cached = read_json_cache(self.cache_file).get(key)
        if cached and not self.refresh:
            return {**cached, "source": "cache"}
        started = measuring(question, self.cache_file)
        with forked_rng(self.device):  # a measurement leaves the run's random stream as it was
            record = {**measure(), "measured_at": time.strftime(STAMP)}
        measured(question, started)
        stop_if_signalled()  # a stop signal the measured code caught: its answer is not kept
        if record.get("under_load") is None:
            self.keep(question, params, record)
            return {**record, "source": "measured"}
        if cached:  # this one is unreliable; the quiet one of an earlier run stands
            return {**cached, "source": "cache", "rejected": record}
        return {**record, "source": "measured_under_load"}

    def keep(self, question: str, params: dict[str, Any], record: dict) -> None:
        """Cache `record` (stamped with the time, unless it is) as the answer to `question` with these
        `params`: `answer`'s quiet measurements, and one every rank took part in (the loader trial)."""
        record = {"measured_at": time.strftime(STAMP), **record}
        update_json_cache(self.cache_file, self._key(question, params), record)

    def matmul(self, shapes: list[tuple[int, int, int]]) -> dict:
        return self.answer("matmul", {"shapes": shapes}, lambda: measure_matmul(self.device, shapes))

    def attention(
        self,
        dtype: torch.dtype,
        shape: tuple[int, int, int, int],
        *,
        backward: bool = True,
        dropout: tuple[float, str] = (0.0, "standard"),
        bounds: Sequence[float] = (),
    ) -> dict:
        # training without dropout keeps its key; inference's (forward alone) and dropout's are their own;
        # `bounds` (where the reader's choice turns) only let a clear answer stop sooner: not in the key
        params: dict[str, Any] = {"dtype": dtype, "shape": shape}
        if not backward:
            params["backward"] = False
        elif dropout[0] > 0:
            params["dropout"] = [float(dropout[0]), str(dropout[1])]  # a plain key: the impl may be a StrEnum
        if self.device.type == "cuda":  # answers timed at new row counts too (not in older caches)
            params["new_shapes"] = NEW_SHAPES
        measure = lambda: measure_attention(self.device, dtype, shape, backward, dropout, bounds)  # noqa: E731
        return self.answer("attention", params, measure)

    def compiler_import(self) -> dict:
        return self.answer("compiler_import", {}, measure_compiler_import)

    def compile(self, block: tuple[int, int, int, int, int] | None, dtype: torch.dtype) -> dict:
        params = {"block": block, "dtype": dtype}
        return self.answer("compile", params, lambda: measure_compile(self.device, block, dtype))


# ASV rows of the attention probe, at most: the headline's batches encode 223-287 distinct ASVs. Fewer
# misled it: at 108 rows a bf16 [rows, 4, 151, 151] score tensor (20 MB) stays in a 32 MB L3 cache
# between the probe's back-to-back trials, and the written-out math timed 0.8x the chunked one with
# dropout, which trained as fast and in 0.8x the memory; at 256 rows 0.68x the other way round
# (AVX-512 EPYC, 2026-11-24).
ATTENTION_ROWS = 256


def model_shapes(
    model_cfg: Any, micro_batch: int, max_asvs: int
) -> tuple[list[tuple[int, int, int]], tuple[int, int, int, int] | None]:
    """AAM's ASV-encoder matmuls ([rows * seq_len, D] x [D, 3D | 4D] and back) and attention shape
    [rows, heads, seq_len, head_dim] at this batch, rows capped (matmuls where the rate stops changing,
    attention at ATTENTION_ROWS); for a
    model without these config keys: no shapes (the probe's square matmul and default attention)."""
    if not {"embedding_dim", "ffn_mult", "seq_len", "num_heads"} <= set(model_cfg.keys()):
        return [], None
    dim, length, heads = model_cfg.embedding_dim, model_cfg.seq_len, model_cfg.num_heads
    tokens = min(micro_batch * max_asvs * length, MAX_ROWS)
    ffn = model_cfg.ffn_mult * dim
    matmuls = [(tokens, dim, ffn), (tokens, ffn, dim), (tokens, dim, 3 * dim)]
    rows = min(micro_batch * max_asvs, ATTENTION_ROWS)
    return matmuls, (rows, heads, length, dim // heads)
