"""The machine a figure is measured on: its CPU (model, generation, matmul flags: `cpu_description`), the
host with its cores and GPU as a run's summary names it (`machine`), and the key a CPU peak is cached
under (`machine_key`)."""

import os
import platform
import socket
from pathlib import Path

import torch

from aamperf.cgroups import cpu_quota, usable_cores

# CPU flags that change which matmul kernels run: a cached peak is only valid with the same set.
_MATMUL_FLAGS = (
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "amx_tile",
    "avx512_bf16",
    "avx512_fp16",
    "avx512f",
    "avx2",
    "fma",
)


def cpuinfo() -> tuple[str, list[str], str]:
    """This machine's `parse_cpuinfo`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def parse_cpuinfo(text: str) -> tuple[str, list[str], str]:
    """The first CPU's model name, its matmul flags and its generation (x86's family, model and stepping:
    under a hypervisor the name can be as bare as "AMD EPYC", the same for CPUs of unlike speeds)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough: the others repeat it
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = sorted(set(fields.get("flags", "").split()) & set(_MATMUL_FLAGS))
    parts = [(key.split()[-1], fields.get(key)) for key in ("cpu family", "model", "stepping")]
    generation = " ".join(f"{key} {value}" for key, value in parts if value is not None)
    return name, flags, generation


def cpu_description() -> str:
    """The CPU's model name, its generation and its matmul-relevant flags, to name beside a figure
    measured on it: "AMD EPYC (family 26 model 2 stepping 1; avx2, avx512_bf16, avx512f, fma)"."""
    name, flags, generation = cpuinfo()
    return f"{name} ({'; '.join(filter(None, [generation, ', '.join(flags) or 'no AVX-512 / AMX']))})"


def machine(device: torch.device) -> str:
    """The machine a run's figures are measured on, as its summary.json and the comparison report name
    it: the host, its CPU (model, matmul flags, cores; those the process was started on where fewer,
    e.g. `taskset`, and a cgroup's CPU quota) and the GPU a CUDA run used."""
    quota, cores = cpu_quota(), os.cpu_count() or 1
    usable = len(usable_cores())
    limits = ([f"{usable} usable"] if usable < cores else []) + (
        [f"a CPU quota of {quota:g}"] if quota is not None else []
    )
    text = f"{platform.node()}: {cpu_description()}, {cores} cores" + (
        f" ({', '.join(limits)})" if limits else ""
    )
    return text + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")


def _machine_id() -> str:
    try:
        return Path("/etc/machine-id").read_text().strip()
    except OSError:
        return ""


# Settings that hold oneDNN's and MKL's kernels below what the CPU's flags offer (the same machine, other
# speeds); ATEN_CPU_CAPABILITY, torch's own cap, shows in torch.backends.cpu.get_cpu_capability()
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_key(precision: str, threads: int) -> str:
    """The cache key of a CPU peak: this machine (machine-id + hostname: containers of one image share
    a machine-id), its CPU model, generation and matmul flags, the instruction set torch's kernels use
    (its vector kernels' and any cap set on oneDNN's or MKL's), the thread count and the CPU time a
    cgroup grants (the same threads under a quota are throttled), torch and the dtype."""
    name, flags, generation = cpuinfo()
    host = socket.gethostname()
    isa = [f"isa={torch.backends.cpu.get_cpu_capability()}"]
    isa += [f"{cap}={os.environ[cap]}" for cap in ISA_CAPS if os.environ.get(cap)]
    quota = cpu_quota()
    threads_text = f"threads={threads}" + ("" if quota is None else f",cpu_quota={quota:g}")
    return (
        f"{_machine_id()}|{host}|{name}|{generation}|{','.join(flags)}|{','.join(isa)}|{threads_text}|"
        f"torch={torch.__version__}|{precision}"
    )
