"""The schema of `python -m aamperf.predict` (conf/predict.yaml): which run, which samples, what to write."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from aamperf.config import (
    AAMOpsConfig,
    AsvSampling,
    AttentionConfig,
    CompileConfig,
    PrecisionConfig,
    ProbeConfig,
    choices,
    register_configs,
)

Quantize = choices("Quantize", "none", "int8_dynamic")
Mask = choices("Mask", "run", "none")  # the bases predict hides (aamperf/predict/masks.py)
DEFAULT_MAX_PROBABILITY_DIFF = 0.01  # bench: a level keeps a classification's probabilities within this


@dataclass
class QuantizeConfig:
    """Inference-time quantization (`aamperf/predict/levels.py`, conf/quantize/)."""

    mode: Quantize = Quantize.none  # int8_dynamic: nn.Linear weights in int8 (CPU, with precision=fp32)


@dataclass
class PredictData:
    """The samples to predict for: the run's own data where every key is null; a new table with
    `data.table` (its metadata and target column to compare the predicted target with, its sequences
    where the observation ids are not sequences). Rarefaction and the ASV cut follow the run's."""

    table: str | None = None  # BIOM (HDF5 or JSON); its ASVs may be new: the model reads their sequences
    metadata: str | None = None  # TSV, first column the sample id
    target: str | None = None  # the column to compare predicted targets with (default: the run's column)
    sequences: str | None = None  # FASTA id -> sequence, when observation ids are not sequences
    # which ASVs of a sample with more than max_asvs the model reads: null the run's data.asv_sampling;
    # abundance | first | random (draw 0, and with `passes` draws 0 to passes - 1)
    asv_sampling: AsvSampling | None = None


@dataclass
class PredictAutoBatch:
    """batch_size=auto: the largest batch whose forward pass fits (`aamperf/batch_size.py`)."""

    budget_fraction: float = 0.6  # of the memory this process can have (device memory on a GPU)
    budget_gib: float | None = None  # a fixed budget instead (GiB)
    max_batch: int = 1024  # the search stops here (and at the number of samples)
    tolerance: float = 0.1  # bisect until the largest fitting batch is known within this fraction


@dataclass
class BenchConfig:
    """bench.enabled=true: latency per batch size instead of prediction files (`aamperf/predict/bench.py`)."""

    enabled: bool = False
    batch_sizes: list[int] = field(default_factory=lambda: [1, 32])  # each: the first samples, one batch
    warmup: int = 5  # calls before timing
    calls: int = 50  # timed calls per batch size: p50 and p95 over them
    min_cosine: float = 0.999  # a level keeps quality: its embeddings' worst cosine to fp32 eager's ...
    max_target_mae_std: float = 0.01  # ... and its target within this many target standard deviations
    # ... or, a classification's, each class probability within this much
    max_probability_diff: float = DEFAULT_MAX_PROBABILITY_DIFF


DEFAULT_PROBE_CACHE = "${oc.env:AAMPERF_CACHE,${oc.env:HOME}/.cache/aamperf}/device_probe.json"


@dataclass
class PredictConfig:
    run: str = MISSING  # a completed run's directory: it holds model.pt
    inference: str = MISSING  # the level's name, set by conf/inference/*.yaml
    data: PredictData = field(default_factory=PredictData)
    batch_size: Any = 32  # samples per forward pass, or auto: the largest that fits auto_batch's budget
    auto_batch: PredictAutoBatch = field(default_factory=PredictAutoBatch)
    # a table of more samples is read (HDF5: only these samples' counts), rarefied and predicted a chunk
    # at a time, so memory does not grow with it; 0: the whole table at once
    chunk_samples: int = 10000
    pairwise: bool = False  # also the predicted UniFrac between every pair of samples (unifrac.npy, n x n)
    # each sample through the model this many times, each with its own draw of ASVs (data.asv_sampling=random)
    # and of hidden bases (mask=run); written: the mean embedding and target (a class's mean probabilities),
    # a regression's `predicted_std`
    passes: int = 1
    # the bases each pass hides: run, as the run's training hid them (its loss.mask_fraction and
    # mask_strategy, where its loss.nucleotide_weight > 0: the model reads what it learnt from; each pass
    # another draw); none: whole sequences
    mask: Mask = Mask.run
    # the inference level: the training groups that apply to a forward pass, plus quantize (conf/inference/)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    aam_ops: AAMOpsConfig = field(default_factory=AAMOpsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    probe: ProbeConfig = field(default_factory=lambda: ProbeConfig(cache=DEFAULT_PROBE_CACHE))
    quality_samples: int = 64  # the first samples, also through the fp32 eager model: the level's quality
    bench: BenchConfig = field(default_factory=BenchConfig)
    export: bool = False  # also model.pt2: the model as a torch.export program (aamperf/predict/export.py)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    timeout_s: int = 600  # under torchrun: a collective waiting longer than this fails instead of hanging
    progress: bool = True  # tqdm bar with samples/s
    # glibc keeps freed blocks (up to 1 GiB) for the next batch instead of returning them to the OS, as the
    # training option of that name (aamperf/phases/system.py): without it every batch faults its pages in
    # again (inference=baseline at batch 32 2.2x slower, 1.25x less peak RSS: docs/predict.md), and a bench
    # sweep's first job ran 1.1-1.5x slower than the same level after it in one process
    reuse_freed_memory: bool = True
    # gperftools' tcmalloc preloaded where it is installed: the command starts itself again with it before
    # torch loads, as training does (aamperf/allocator.py); null: malloc as the process has it
    allocator: str | None = "tcmalloc"


def register_predict_configs() -> None:
    register_configs()  # the resolvers the run directory's name uses
    ConfigStore.instance().store(name="predict_schema", node=PredictConfig)
