"""Config schemas: dataclasses in Hydra's ConfigStore, so a misspelled key, a wrong type or a choice
that is not one of its enum's members is refused at compose time."""

import datetime
import hashlib
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# Absolute, so found from any working directory: conf/ beside the package in a checkout (and an
# editable install); aamperf/conf in an installed wheel, where pyproject.toml ships conf/ as it is.
_INSTALLED_CONF = Path(__file__).resolve().parent / "conf"
CONF_DIR = _INSTALLED_CONF if _INSTALLED_CONF.is_dir() else Path(__file__).resolve().parents[1] / "conf"


def choices(name: str, *values: str) -> type[StrEnum]:
    """A closed choice. OmegaConf looks a value up by member name, so each name is its value (which
    may hold a '-'); a member compares equal to its string and formats as it."""
    return StrEnum(name, {value: value for value in values}, module=__name__)


DataSource = choices("DataSource", "simulated", "biom")
UnifracMode = choices("UnifracMode", "batch", "precomputed")
UnifracMetric = choices("UnifracMetric", "unweighted", "weighted_normalized")
AsvSampling = choices("AsvSampling", "abundance", "first", "random")
Dtype = choices("Dtype", "fp32", "bf16", "fp16", "auto")
MatmulPrecision = choices("MatmulPrecision", "highest", "high", "medium")
Residual = choices("Residual", "fp32", "autocast")
CompileMode = choices("CompileMode", "disabled", "default", "reduce-overhead", "max-autotune", "auto")
AttentionImpl = choices("AttentionImpl", "math", "sdpa", "auto")
SdpaBackend = choices("SdpaBackend", "flash", "efficient", "cudnn", "math")
DropoutImpl = choices("DropoutImpl", "standard", "fast")
Checkpointing = choices("Checkpointing", "none", "full", "selective", "ops", "budget", "auto")
OptimizerImpl = choices("OptimizerImpl", "for_loop", "foreach", "fused")
OptimizerAlgorithm = choices("OptimizerAlgorithm", "adamw", "adam", "sgd")
LrSchedule = choices(
    "LrSchedule", "warmup_cosine", "warmup_linear", "constant", "onecycle", "plateau", "cosine_restarts"
)
Resume = choices("Resume", "disabled", "auto")
Strategy = choices("Strategy", "none", "ddp", "fsdp")
DistBackend = choices("DistBackend", "auto", "gloo", "nccl")
CommHook = choices("CommHook", "none", "fp16", "bf16")
LoggerBackend = choices("LoggerBackend", "none", "wandb", "tensorboard")
WandbMode = choices("WandbMode", "auto", "online", "offline", "disabled")
TargetType = choices("TargetType", "auto", "regression", "classification")
TargetTransform = choices(
    "TargetTransform", "none", "zscore", "minmax", "log_zscore", "log1p_zscore", "log1p_minmax",
    "zscore_category",
)  # fmt: skip
Freeze = choices("Freeze", "none", "encoder", "asv_encoder")


@dataclass
class DataConfig:
    """Where samples come from and how they become batches (`conf/data/`)."""

    source: DataSource = DataSource.simulated
    cache_dir: str = "${oc.env:AAMPERF_CACHE,${oc.env:HOME}/.cache/aamperf}"  # simulated data, UniFrac
    # the data's randomness (simulated data set, rarefaction, train/validation split), apart from `seed`
    # (initialization, batch order, dropout, masks): fixed across a sweep, so every configuration is
    # trained and validated on the same samples and its runs pair with the baseline's by `seed`
    seed: int = 0
    # simulated: sizes of the generated data set (its content depends only on these and data.seed)
    n_samples: int = 256
    n_asvs: int = 512
    n_envs: int = 4
    mean_richness: int = 80  # mean number of distinct ASVs per sample
    depth: int = 5000  # reads per sample before rarefaction
    # biom: the user's files
    table: str | None = None  # BIOM (HDF5 or JSON)
    tree: str | None = None  # Newick; UniFrac is computed from it
    unifrac: str | None = None  # precomputed matrix (.npy with .ids.txt beside it, .h5, .csv)
    metadata: str | None = None  # TSV, first column sample id
    target: str | None = None  # metadata column to predict (a number, or a class)
    # auto: a numeric column is a regression, any other a classification (its distinct values the classes)
    target_type: TargetType = TargetType.auto
    # a regression's target as the model learns it, fitted on the training samples (aamperf/targets.py);
    # every reported figure is in the target's own units
    target_transform: TargetTransform = TargetTransform.zscore
    # zscore_category: the metadata columns whose categories each z-score their own samples (a site, a
    # season: the original AAM's --normalize-by), fitted on the training samples
    normalize_by: list[str] = field(default_factory=list)
    # the metadata columns whose categories weigh the target part (loss.category_weights: the original AAM's
    # --categorical-loss-weight-column), each sample's weight its category's
    weight_by: list[str] = field(default_factory=list)
    # metadata columns the target head is conditioned on (aamperf/data/categorical.py): each embedded and
    # fused into the sample embedding the head reads (model.categorical_fusion); vocabularies of the
    # training samples, slot 0 for a missing value or (at predict) a category training never saw
    categorical: list[str] = field(default_factory=list)
    sequences: str | None = None  # FASTA id -> sequence, when observation ids are not sequences
    # batch: each batch's UniFrac from its samples' branch sets (the tree's), on the run's device;
    # precomputed: the whole n x n matrix up front (data.unifrac's, or scikit-bio's from data.tree, cached);
    # null: batch with data.tree, precomputed with data.unifrac
    unifrac_mode: UnifracMode | None = None
    # what UniFrac data.tree gives: unweighted (which branches two samples share), or weighted_normalized
    # (their reads' share on each branch; scikit-bio's, computed up front: data.unifrac_mode=precomputed)
    unifrac_metric: UnifracMetric = UnifracMetric.unweighted
    # pipeline
    rarefy_depth: int = 1000
    max_asvs: int = "${model.max_asvs}"  # type: ignore[assignment]  # ASVs a sample keeps (asv_sampling's)
    # which of a sample's ASVs it keeps when it has more than max_asvs (aamperf/data/samples.py): abundance
    # (the most abundant), first (the first in the table's order: the original AAM's default), random (a
    # new draw each pass over the training samples; validation and predict draw 0 unless predict.passes)
    asv_sampling: AsvSampling = AsvSampling.abundance
    val_fraction: float = 0.2
    # a text file of sample ids, one per line (as the original AAM's <output>/val_samples.txt): those samples
    # validate, every other sample of the data trains, and val_fraction is not used; null: the seeded split
    val_samples: str | None = None


@dataclass
class DataloaderConfig:
    """torch DataLoader settings (`conf/dataloader/`)."""

    num_workers: Any = 0  # an integer >= 0, or auto (measured: aamperf/phases/dataloader.py)
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    non_blocking: bool = False


@dataclass
class PrecisionConfig:
    """Mixed precision (`aamperf/phases/precision.py`)."""

    dtype: Dtype = Dtype.fp32  # fp16 needs CUDA (its GradScaler has no CPU use here); auto: measured
    # torch.set_float32_matmul_precision; high lets CUDA use TF32 for fp32 matmuls
    matmul_precision: MatmulPrecision = MatmulPrecision.highest
    # the transformer stacks' residual stream and LayerNorms under autocast: fp32 (autocast's own rule), or in
    # the autocast dtype (2-byte activations, no casts around the norms)
    residual: Residual = Residual.fp32


@dataclass
class CompileConfig:
    """torch.compile (`aamperf/phases/compile.py`)."""

    mode: CompileMode = CompileMode.disabled  # auto: measured (aamperf/phases/compile.py)
    backend: str = "inductor"
    dynamic: bool | None = None  # None: torch decides; True for shapes that change per batch
    fullgraph: bool = False
    per_block: bool = True  # compile each transformer block: no graph breaks at AAM's data-dependent ops


@dataclass
class AttentionConfig:
    """Attention implementation (`aamperf/phases/attention.py`)."""

    # math: matmul + softmax, written out; sdpa: F.scaled_dot_product_attention; auto: measured
    impl: AttentionImpl = AttentionImpl.math
    backends: list[SdpaBackend] = field(default_factory=list)  # the sdpa kernels to allow; []: torch chooses


@dataclass
class DropoutConfig:
    """How dropout masks are drawn (`aamperf/phases/dropout.py`)."""

    impl: DropoutImpl = DropoutImpl.standard  # torch's Bernoulli; fast: 16 random bits per element (CPU)
    # fast: threads that draw the masks' random words (the same words on any number); null: torch's threads
    threads: int | None = None


@dataclass
class MemoryConfig:
    """Activation checkpointing (`aamperf/phases/memory.py`), the memory guard (`aamperf/guards/`)."""

    checkpointing: Checkpointing = Checkpointing.none  # full: every transformer layer; selective: every k-th
    # ops: every layer, its matmuls' and attention's outputs kept, the other ops recomputed; budget: what
    # torch.compile's partitioner keeps, within activation_budget
    recompute_every: int = 2  # selective (and auto in fp32): recompute layers 0, k, 2k, ...
    activation_budget: float = 0.5  # budget: the fraction of compile's saved activations kept (0: least)
    warn_fraction: float = 0.90  # of system RAM (CPU) or device memory: gc + cache clearing, warning
    max_fraction: float = 0.97  # ... checkpoint and stop (status aborted) before the system's OOM killer
    cuda_memory_fraction: float | None = None  # cap this process's share of the GPU
    expandable_segments: bool = False  # the CUDA allocator's expandable_segments:True (GPU), set per job


@dataclass
class OptimizerConfig:
    """The optimizer (`aamperf/phases/optimizer.py`); lr and weight decay are trainer.*."""

    impl: OptimizerImpl = OptimizerImpl.for_loop  # how it runs: the group's option, the levels' choice
    # its update: AdamW (decoupled weight decay); Adam and SGD (weight decay an L2 penalty on the gradient),
    # the original AAM's --optimizer adam | sgd
    algorithm: OptimizerAlgorithm = OptimizerAlgorithm.adamw
    # SGD's (the original's); trainer.lr_schedule=onecycle cycles it between 0.85 and 0.95 instead (torch's
    # OneCycleLR cycles every optimizer's momentum, Adam's and AdamW's beta1)
    momentum: float = 0.9
    # the lr of the categorical conditioning's parameters (data.categorical's embeddings, their fusion, the
    # output scaling), scheduled as trainer.lr is: the original AAM's --categorical-lr; null: trainer.lr
    categorical_lr: float | None = None


@dataclass
class AAMOpsConfig:
    """AAM-specific work (`aamperf/phases/aam_ops.py`)."""

    dedup: bool = False  # encode each distinct ASV of a batch once, scatter the vectors back
    skip_padding: bool = False  # pad a batch to its longest sample, not data.max_asvs
    bucket: bool = False  # round encoded rows and batch widths up to a few sizes (reused graphs and memory)
    pack_samples: bool = False  # the sample level on each sample's real ASVs packed: varlen attention
    unmask_full_length: bool = False  # data of full-length ASVs only: the ASV encoder runs with no mask


@dataclass
class SystemConfig:
    """Process-level switches (`aamperf/phases/system.py`)."""

    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    interop_threads: int | None = None
    cpu_cores: list[int] | None = None  # pin the training process to these cores (Linux); None: leave as is
    cudnn_benchmark: bool = False
    deterministic: bool = False  # torch.use_deterministic_algorithms
    channels_last: bool = False  # only for models with 4-D activations
    reuse_freed_memory: bool = False  # glibc keeps freed blocks for the next step instead of unmapping them
    allocator: str | None = None  # tcmalloc: preloaded at the process's start (aamperf/allocator.py)


@dataclass
class AutoBatchConfig:
    """The batch-size finder, for trainer.batch_size=auto (`aamperf/batch_size.py`)."""

    budget_fraction: float = 0.6  # of device memory (CUDA) or of the RAM this run can have (CPU), per rank
    budget_gib: float | None = None  # a fixed budget per rank instead (GiB): the same on any machine
    max_batch: int = 1024  # the search stops here (and at the number of training samples)
    tolerance: float = 0.1  # bisect until the largest fitting batch is known within this fraction
    effective_batch: int | None = None  # samples per optimizer step to keep: grad_accum_steps is derived


@dataclass
class TrainerConfig:
    """The training loop (`aamperf/trainer/`)."""

    max_steps: int = 100
    # samples per optimizer step, over all ranks (the global batch; UniFrac needs >= 2), or "auto": the
    # largest that fits trainer.auto_batch's memory budget, measured before training (summary: batch_finder)
    batch_size: Any = 8
    auto_batch: AutoBatchConfig = field(default_factory=AutoBatchConfig)
    # micro-batches per optimizer step, each of batch_size / grad_accum_steps: the step is the whole batch's
    # (UniFrac over every pair, by gradient caching: one more forward per micro-batch; trainer/gradcache.py)
    grad_accum_steps: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.01
    lr_schedule: LrSchedule = LrSchedule.warmup_cosine  # torch's schedulers (aamperf/trainer/schedule.py)
    warmup_steps: int = 10  # linear warm-up (onecycle: its rise)
    # warmup_cosine / warmup_linear decay to lr * min_lr_ratio at max_steps (cosine_restarts: each cycle)
    min_lr_ratio: float = 0.1
    # lr_schedule=plateau: after the warm-up, the lr times plateau_factor (down to lr * min_lr_ratio) once
    # more than plateau_patience validations in a row did not improve `monitor` (torch's
    # ReduceLROnPlateau; the original AAM's --scheduler plateau, --scheduler-factor, --scheduler-patience)
    plateau_factor: float = 0.3
    plateau_patience: int = 5
    # lr_schedule=cosine_restarts: after the warm-up, cosine from the lr to lr * min_lr_ratio over
    # restart_steps (null: a quarter of the steps after the warm-up), then again from the lr, each cycle
    # restart_mult times as long (torch's CosineAnnealingWarmRestarts; the original AAM's
    # --scheduler cosine_restarts, --scheduler-t0, --scheduler-t-mult)
    restart_steps: int | None = None
    restart_mult: int = 2
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_nonfinite: int = 10  # non-finite steps in a row (each skipped) before the run stops as aborted
    val_every: int = 50  # steps between validations (and one at the end)
    val_batches: int = 4  # batches per validation, so validation cost does not grow with data
    # samples per validation batch (all ranks); null: the training micro-batch. The UniFrac part of a val
    # loss is over the pairs inside each batch, so runs at other batch sizes compare at the same one
    val_batch_size: int | None = None
    # times each validation reads its samples: pass k their ASVs' draw k (data.asv_sampling=random) and the
    # bases the loss hides at step k; the loss over all passes, the target's figures of each sample's mean
    # output (the original AAM's --val-prediction-passes; predict's `passes`)
    val_passes: int = 1
    # early stopping: the run ends after this many validations in a row whose `monitor` figure did not
    # improve on its best by more than `min_delta` (0: never; the original AAM's --patience, in epochs there)
    patience: int = 0
    # a validation figure: val_loss, a part of it (val_unifrac, val_nucleotide, val_target), val_target_mae,
    # _rmse, _r2, val_accuracy, val_macro_f1, val_roc_auc (R^2, accuracy, F1, AUC upward; the others down)
    monitor: str = "val_loss"
    min_delta: float = 0.0
    # model.pt and the run's validation figures are its best validation's by `monitor` (the original's
    # best_model.pt), not its last step's (trainer/best.py)
    keep_best: bool = False
    checkpoint_every: int = 0  # steps between checkpoints in <run dir>/checkpoints; 0: none
    keep_last: int = 2  # checkpoints kept, newest first
    resume: Resume = Resume.disabled  # auto: go on from the newest checkpoint of this run directory
    progress: bool = True  # tqdm bar with loss and samples/s
    # one process on a GPU: a step waits for the step before it, not its own work, so the GPU runs it while
    # the host launches the next (steps drained at log lines, validation, checkpoints and the end, where the
    # step times sum to the wall time); false: each step waits for its own (trainer/loop.py TrainStep.wait)
    overlap_steps: bool = True


@dataclass
class MetricsConfig:
    """What goes into metrics.jsonl and summary.json (`aamperf/metrics/`)."""

    log_every: int = 10  # steps between metrics.jsonl lines (host syncs happen only here)
    skip_steps: int = 3  # warm-up steps excluded from timing
    flop_batches: int = 8  # batches the FLOPs per step are averaged over (AAM's work varies per batch)
    monitor_interval_s: float = 0.2  # psutil / pynvml sampling period (background thread)
    # torch.profiler over this many steps after warm-up (trace, top ops, comm share; left out of timing)
    profile_steps: int = 0
    # memory over 2 steps after those (left out of timing): a GPU's allocator history (memory_snapshot.pickle,
    # for pytorch.org/memory_viz), a CPU's profiler memory timeline (memory_timeline.json)
    memory_snapshot: bool = False
    peak_flops_cache: str = "${data.cache_dir}/peak_flops.json"
    # the device's dense peak FLOP/s for the run's matmul dtype, from its data sheet: for a GPU not in
    # aamperf/metrics/gpu_peaks.py (e.g. an A10G); null: that table (GPU) or a calibration (CPU)
    peak_flops: float | None = None
    # a run with data.target: a random forest on the same samples' ASV counts after training, its figures
    # beside the model's (summary.json rf_baseline; aamperf/metrics/rf_baseline.py). About 1 s on the
    # default simulated data (2 cores), outside every timed figure; false skips it
    rf_baseline: bool = True


@dataclass
class DistributedConfig:
    """torch.distributed via torchrun (`aamperf/distributed.py`); trainer.batch_size is the global batch."""

    strategy: Strategy = Strategy.none  # none: one process; fsdp: FSDP2, fully_shard per layer + root
    backend: DistBackend = DistBackend.auto  # auto: nccl on GPU, gloo on CPU
    timeout_s: int = 600  # a collective waiting longer than this fails instead of hanging (a wait for
    # rank 0's measuring or a rank's compile lasts while that rank works: aamperf/distributed.py Waits)
    # ddp
    bucket_cap_mb: float = 25.0  # gradients all-reduced in buckets of this size, overlapping backward
    static_graph: bool = False  # the same used parameters every step: lets DDP skip per-step bookkeeping
    comm_hook: CommHook = CommHook.none  # fp16 | bf16: compress gradients for the all-reduce (half the bytes)
    find_unused_parameters: bool = False  # a model with parameters some steps do not use
    # fsdp
    reshard_after_forward: bool = True  # free gathered parameters after forward: less memory, 1 more gather


@dataclass
class LoggerConfig:
    """Where metrics go beside metrics.jsonl (`aamperf/loggers.py`)."""

    backend: LoggerBackend = LoggerBackend.none
    project: str = "aamperf"  # W&B project
    entity: str | None = None  # W&B team or user; None: the key's default
    group: str | None = None  # W&B group; None: the sweep's directory name in a multirun
    mode: WandbMode = WandbMode.auto  # W&B; auto: online with an API key, else offline
    tags: list[str] = field(default_factory=list)


@dataclass
class CompareConfig:
    """The report a multirun ends with (`aamperf/callbacks.py`; the same as `python -m aamperf.compare`)."""

    baseline: str = "optim=baseline"  # the override string of the baseline jobs, e.g. "precision=fp32"
    quality_tolerance: float = 0.02  # equal quality: the paired val-loss change's interval within +-this
    confidence: float = 0.95  # confidence level of the bootstrap intervals over paired seeds


@dataclass
class ProbeConfig:
    """The device probe that `auto` options read (`aamperf/probe.py`)."""

    cache: str = "${data.cache_dir}/device_probe.json"  # answers per device (delete it to forget them)
    refresh: bool = False  # measure again now (and replace the cached answers)


@dataclass
class InitConfig:
    """Where a run's weights start (`aamperf/finetune.py`): AAM's stage 2 starts from stage 1's."""

    # a run directory holding model.pt (every completed run writes one): its weights, by name and shape,
    # into this run's model (built from this run's `model`; the file's config builds nothing), all but
    # the heads stage 2 trains fresh (target_head); null: a fresh model
    from_run: str | None = None


@dataclass
class FinetuneConfig:
    """What of a pretrained model trains on (`aamperf/finetune.py`)."""

    # the parts that keep their pretrained weights (requires_grad off, left out of the optimizer, dropout
    # off): encoder: all that makes the sample embedding; asv_encoder: the nucleotide level only
    freeze: Freeze = Freeze.none
    # auto | true | false: train the heads on each sample's embedding computed once (a frozen encoder's, and
    # its per-ASV states for model.target_head=transformer: aamperf/trainer/cached.py); auto: where it gives
    # the same losses (freeze=encoder, no nucleotide part) and the states fit in memory
    cache_embeddings: Any = "auto"


@dataclass
class SearchConfig:
    """Auto-tuning (`aamperf/search.py`, conf/hparams_search/): set by hparams_search=fastest."""

    reference: str | None = None  # summary.json of the baseline run that sets the quality bar


@dataclass
class AlertLevels:
    """A threshold's two levels; null: not checked."""

    warn: float | None = None
    critical: float | None = None


@dataclass
class AlertsConfig:
    """Thresholds checked at every log line (`aamperf/alerts.py`); each crossing is an alert in train.log,
    summary.json `alerts` and W&B (`run.alert`). Memory's levels are memory.warn_fraction and
    memory.max_fraction (the memory guard's)."""

    samples_per_s: AlertLevels = field(default_factory=AlertLevels)  # a floor: throughput of the interval
    val_loss: AlertLevels = field(default_factory=AlertLevels)  # a ceiling: at each validation
    gpu_util_percent: AlertLevels = field(default_factory=AlertLevels)  # a floor: mean so far (CUDA only)
    stop_on_critical: bool = False  # a critical alert stops the run: checkpoint, status aborted, exit 3


@dataclass
class Config:
    """The whole run. `model` is open: any `_target_` returning an nn.Module, with its own kwargs."""

    data: DataConfig = field(default_factory=DataConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    model: Any = MISSING
    loss: Any = MISSING  # open like model: `_target_` + kwargs, called as loss(model, batch, step)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    dropout: DropoutConfig = field(default_factory=DropoutConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    aam_ops: AAMOpsConfig = field(default_factory=AAMOpsConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    init: InitConfig = field(default_factory=InitConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    optim: str = MISSING  # the level's name: each conf/optim/*.yaml sets its own (config.yaml: baseline)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0


def job_dirname(overrides: str) -> str:
    """A sweep job's directory name from its overrides: no path separator, short enough for any disk."""
    name = overrides.replace("/", "_")
    return name if len(name) <= 100 else name[:90] + "..." + hashlib.sha1(name.encode()).hexdigest()[:7]


def launch_time(fmt: str) -> str:
    """When this run was started, for its directory name. Under torchrun (or srun): when the launcher
    started (the parent of every rank on a node), so that all its ranks name the same directory."""
    launched = "LOCAL_RANK" in os.environ or "SLURM_LOCALID" in os.environ  # torchrun or srun
    started = psutil.Process(os.getppid()).create_time() if launched else time.time()
    return datetime.datetime.fromtimestamp(started).strftime(fmt)


def launch_id() -> str:
    """Which launch this is, beside its time in its directory's name, so that two runs started in the
    same second get two directories: the SLURM job, torchrun's process (shared by its ranks), or this
    process."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_LOCALID" in os.environ:
        return f"job{os.environ['SLURM_JOB_ID']}"
    return f"pid{os.getppid() if 'LOCAL_RANK' in os.environ else os.getpid()}"


def rank_suffix() -> str:
    """ "" for the first (or only) process, "_rank<N>" for the others: one log file per rank."""
    rank = int(os.environ.get("RANK", 0))
    return f"_rank{rank}" if rank else ""


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A resolved config's leaves under their dotted keys (`{"trainer.lr": 0.001, ...}`)."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): node}


def under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether dotted `key` is one of `prefixes` or inside one (`trainer.lr` is under `trainer`)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_diff(old: dict[str, Any], new: dict[str, Any], ignored: tuple[str, ...] = ()) -> dict[str, list]:
    """{dotted key: [old value, new value]} for every key of two resolved configs whose value differs,
    keys `under` `ignored` left out (a resume against its checkpoint, a run against its baseline)."""
    before, after = flat(old), flat(new)
    return {
        k: [before.get(k), after.get(k)]
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k) and not under(k, ignored)
    }


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("aamperf.job_dirname", job_dirname, replace=True)
    # cached: the directory is named once per process, like Hydra's ${now:}
    OmegaConf.register_new_resolver("aamperf.launch_time", launch_time, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("aamperf.launch_id", launch_id, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("aamperf.rank_suffix", rank_suffix, replace=True)
