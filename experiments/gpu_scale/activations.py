"""What one training step of ultra at `aam_base`, batch 8, keeps for backward and holds at its peak,
counted on a CPU.

Every tensor autograd saves during the forward pass (a saved-tensors hook), attributed to the module that
saved it and counted once per storage (parameters left out), on a real batch of the gpu_scale data set
(`experiments/original/prepare.py`, the data run.sh writes); and the process's memory over the step
(RSS: after the forward pass, and its peak), which also covers compiled graphs and checkpointed blocks,
whose insides the hooks do not see. The kernels are the ones ultra runs on a GPU where a CPU's differ:
attention is SDPA's fused kernel with no dropout (on CUDA the dropout lives inside the kernel, which keeps
q, k, v, its output and the log-sum-exp, as the CPU's fused kernel does without dropout), and dropout keeps
a bool mask (`torch.native_dropout`, CUDA's fused dropout; a CPU's nn.Dropout keeps a multiplier in the
activation's dtype). Autocast in `--dtype` (bf16 or fp16: 2 bytes either way).

Usage: python experiments/gpu_scale/activations.py DATA_DIR [CHANGES] [--batch 8] [--dtype bf16] [--json OUT]
CHANGES: overrides on ultra, e.g. `memory=full`, `memory=budget compile=default`,
`precision.residual=autocast` (default: as the H200 ran it at 234 steps, eager, nothing recomputed).
DATA_DIR: run.sh's `$OUT_DIR/data`, or
`python experiments/original/prepare.py DIR 400 3000 600 8000 20000`.
"""

import argparse
import gc
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch import nn

from aamperf.config import CONF_DIR, register_configs
from aamperf.data import build_data
from aamperf.errors import bad_input_exits, exit_bad_input
from aamperf.metrics.host import cpu_description
from aamperf.metrics.monitor import peak_rss, release_freed_memory, reset_peak_rss
from aamperf.model.layers import MathAttention
from aamperf.model.slots import bucket_size
from aamperf.phases.aam_ops import apply_aam_ops, collate_pad_to, set_full_length
from aamperf.phases.compile import apply_compile
from aamperf.phases.memory import apply_checkpointing
from aamperf.phases.precision import apply_residual

GIB = 2**30


class FusedDropout(nn.Module):
    """nn.Dropout as CUDA runs it: one kernel, a bool mask kept for backward."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.native_dropout(x, self.p, self.training)[0] if self.p > 0 else x


class FusedAttention(nn.Module):
    """SDPA with no dropout: on a CPU its fused kernel, which keeps what CUDA's keep (see above)."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def as_on_gpu(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MathAttention):
                setattr(parent, name, FusedAttention())
            elif type(child) is nn.Dropout:
                setattr(parent, name, FusedDropout(child.p))


# what each module of a block keeps for backward (its saved tensors), by its path in the block
KEEPS = {
    "ln_attn": "LayerNorm before attention: its input (the residual stream)",
    "attn.qkv": "qkv Linear: its input (the LayerNorm's output, cast where the norm ran in fp32)",
    "attn.attend": "attention kernel: q, k, v and its output (the log-sum-exp in fp32)",
    "attn.out": "output Linear: its input (where not the kernel's output itself)",
    "dropout": "dropout on the attention branch: its mask",
    "ln_ffn": "LayerNorm before the FFN: its input (the residual stream)",
    "ffn.0": "FFN's first Linear: its input (the LayerNorm's output, cast where the norm ran in fp32)",
    "ffn.1": "GELU: its input (the first Linear's output, 4 D wide)",
    "ffn.2": "dropout after the GELU: its mask (4 D wide)",
    "ffn.3": "FFN's second Linear: its input (the GELU's output after dropout, 4 D wide)",
    "ffn.4": "dropout on the FFN branch: its mask",
}


def part(path: str) -> tuple[str, str]:
    """A module path -> (stack, what in a block): ('asv_encoder', 'ffn.3') for
    'asv_encoder.blocks.2.ffn.3', the layer index dropped."""
    stack, _, rest = path.partition(".blocks.")
    if not rest:
        return "outside the blocks", path or "(the model itself)"
    return stack, re.sub(r"^\d+\.?", "", rest) or "(the block itself: residual adds)"


def encoded_rows(batch: dict) -> int:
    """The rows the ASV encoder runs on for `batch` under aam_ops=fast: its distinct ASVs (the collate's
    slot index has one first slot each, padded to its bucket), bucketed."""
    return bucket_size(batch["unique_first"].numel())


def count(
    data_dir: Path, batch: int, dtype: torch.dtype, epochs: int, changes: list[str], depth: int = 8000
) -> dict:
    """`changes`: overrides on ultra (`compile=default`, `memory=budget compile=default`). Every
    configuration gets the process's memory over a step; the eager one without checkpointing also what
    autograd keeps, by module (`saved_by_module`)."""
    register_configs()
    changed = {c.split("=")[0] for c in changes}
    base = ["compile=disabled", "memory=none"]  # ultra as it ran at 234 steps on the H200 (compile=auto: no)
    overrides = [*(o for o in base if o.split("=")[0] not in changed),
        "model=aam_base", "optim=ultra", "dataloader=simple", "device=cpu", "data=biom",
        f"data.table={data_dir / 'table.biom'}", f"data.unifrac={data_dir / 'unifrac.npy'}",
        f"data.rarefy_depth={depth}", f"trainer.batch_size={batch}", *changes,
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=overrides)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    data = build_data(
        cfg.data, batch_size=batch, seed=0, loader=cfg.dataloader,
        pad_to=collate_pad_to(cfg.aam_ops, cfg.data.max_asvs),
    )  # fmt: skip
    set_full_length(model, data.collate.tokens)  # as the job does: fast drops the ASV encoder's masks here
    apply_residual(model, cfg.precision)  # precision.residual=autocast: the stream and norms in `dtype`
    apply_aam_ops(model, cfg.aam_ops)
    as_on_gpu(model)
    loss_fn = instantiate(cfg.loss)
    step_batch = next(iter(data.train_loader))
    model.train()

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype):
            return loss_fn(model, step_batch, 1)[0]

    compiles = cfg.compile.mode != "disabled"
    recomputed = apply_checkpointing(model, cfg.memory, compiles)  # budget: what compiled graphs keep to
    compiled = None
    if compiles:
        compiled = apply_compile(model, cfg.compile, lambda: forward().backward())
        if compiled["status"] != "applied":
            raise SystemExit(f"compile did not apply: {compiled}")
    else:
        forward().backward()  # as a compile's warm-up: the allocator's state a later step meets
    measured = step_memory(model, forward)
    # hooks see what eager autograd keeps, not what a compiled graph or a checkpointed block keeps inside
    plain = not compiles and recomputed["status"] != "applied"
    kept = saved_by_module(model, forward) if plain else {}
    encoded = [encoded_rows(b) for _ in range(epochs) for b in data.train_loader]
    by_part: dict[tuple[str, str, str], int] = defaultdict(int)
    for path, nbytes, dt in kept.values():
        by_part[(*part(path), dt)] += nbytes
    return {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "changes": changes,
        "compile": compiled,
        "checkpointing": recomputed,
        "batch": batch,
        "tokens_shape": list(step_batch["tokens"].shape),
        "real_asvs": step_batch["n_real_slots"] or step_batch["real_slots"].numel(),  # R, unpadded
        "encoded_rows": encoded_rows(step_batch),
        # the ASV encoder's rows (nearly all the bytes kept) over the run's batches: peak at the largest
        "run_encoded_rows": {"epochs": epochs, "median": statistics.median(encoded), "max": max(encoded)},
        "dtype": str(dtype).removeprefix("torch."),
        "kept_bytes": sum(b for _, b, _ in kept.values()) if kept else None,
        **measured,
        "parts": [
            {"stack": s, "part": p, "dtype": d, "bytes": b}
            for (s, p, d), b in sorted(by_part.items(), key=lambda kv: -kv[1])
        ],
    }


def step_memory(model: nn.Module, forward) -> dict:
    """The process's memory (RSS) through one step, from what it held before: after the forward pass
    (what the step keeps for backward, compiled graphs' too) and at its peak (forward + backward: what
    `torch.cuda.max_memory_allocated` measures on a GPU). Tensors this large are mmapped by glibc
    (over its 32 MiB threshold) and unmapped when freed, so RSS follows them."""
    model.zero_grad(set_to_none=False)  # the gradients' buffers, held between steps, count before
    gc.collect()
    release_freed_memory()
    before = psutil.Process().memory_info().rss
    reset_peak_rss()
    loss = forward()
    after_forward = psutil.Process().memory_info().rss
    loss.backward()
    return {"rss_forward_bytes": after_forward - before, "rss_peak_bytes": peak_rss() - before}


def saved_by_module(model: nn.Module, forward) -> dict[int, tuple[str, int, str]]:
    """Each storage autograd keeps through `forward()` (parameters left out): (the path of the innermost
    module running when it was saved, its bytes, its dtype). For an eager model with no checkpointed
    block: the hooks see neither a compiled graph's insides nor what a checkpoint recomputes."""
    names = {m: n for n, m in model.named_modules()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where: list[str] = []  # the module path stack
    kept: dict[int, tuple[str, int, str]] = {}

    def enter(module: nn.Module, args: tuple) -> None:
        where.append(names[module])

    def leave(module: nn.Module, args: tuple, out: object) -> None:  # a hook's return would replace `out`
        where.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in kept and storage.nbytes():
            kept[ptr] = (where[-1] if where else "", storage.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    hooks = [m.register_forward_pre_hook(enter) for m in model.modules()]
    hooks += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for h in hooks:
            h.remove()
    return kept


def table(found: dict) -> str:
    total, run = found["kept_bytes"], found["run_encoded_rows"]
    changes = " ".join(found["changes"]) or "none (eager, nothing recomputed: as on the H200 at 234 steps)"
    lines = [
        f"ultra, changed: {changes}. Batch {found['batch']}, tokens "
        f"{found['tokens_shape']}, {found['real_asvs']} real ASVs, {found['encoded_rows']} rows encoded; "
        f"autocast {found['dtype']}; {found['cpu']}, torch {found['torch']}",
        f"rows encoded over the run's batches ({run['epochs']} epochs): median {run['median']}, "
        f"largest {run['max']} (x{run['max'] / found['encoded_rows']:.2f} this batch's)",
        f"process memory (RSS) over the step: +{found['rss_forward_bytes'] / GIB:.2f} GiB after the forward "
        f"pass, +{found['rss_peak_bytes'] / GIB:.2f} GiB at its peak",
    ]
    if total is None:
        return "\n".join(lines)
    lines += [
        f"kept for backward (saved-tensor hooks): {total / GIB:.2f} GiB",
        "",
        "| stack | what a block keeps (all its layers) | dtype | GiB | share |",
        "|---|---|---|---|---|",
    ]
    for p in found["parts"]:
        if p["bytes"] / total >= 0.002:
            share = f"{100 * p['bytes'] / total:.1f}%"
            what = KEEPS.get(p["part"], p["part"]) if p["stack"] != "outside the blocks" else p["part"]
            lines.append(f"| {p['stack']} | {what} | {p['dtype']} | {p['bytes'] / GIB:.3f} | {share} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--epochs", type=int, default=6, help="of the run's batches (run.sh: 6)")
    parser.add_argument("changes", nargs="*", help="overrides on ultra: compile=default, memory=budget ...")
    parser.add_argument("--rarefy-depth", type=int, default=8000, help="the data's (run.sh: 8000)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_intermixed_args()
    if not (args.data_dir / "table.biom").is_file():
        prepare = "python experiments/original/prepare.py DIR 400 3000 600 8000 20000"
        exit_bad_input(f"{args.data_dir} holds no table.biom: give run.sh's $OUT_DIR/data, or {prepare}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    with bad_input_exits():  # a bad override or data: aamperf's one `error:` line, exit 2
        found = count(args.data_dir, args.batch, dtype, args.epochs, args.changes, args.rarefy_depth)
    print(table(found))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
