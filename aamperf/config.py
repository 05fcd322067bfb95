"""Config schemas: dataclasses in Hydra's ConfigStore, so a misspelled key is refused at compose time."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class DataConfig:
    """Where samples come from and how they become batches (`conf/data/`)."""

    source: str = "simulated"  # simulated | biom
    cache_dir: str = "${oc.env:AAMPERF_CACHE,${oc.env:HOME}/.cache/aamperf}"  # simulated data, UniFrac
    # simulated: sizes of the generated data set (its content depends only on these and sim_seed)
    n_samples: int = 256
    n_asvs: int = 512
    n_envs: int = 4
    mean_richness: int = 80  # mean number of distinct ASVs per sample
    depth: int = 5000  # reads per sample before rarefaction
    sim_seed: int = 0
    # biom: the user's files
    table: str | None = None  # BIOM (HDF5 or JSON)
    tree: str | None = None  # Newick; UniFrac is computed from it
    unifrac: str | None = None  # precomputed matrix (.npy with .ids.txt beside it, .h5, .csv)
    metadata: str | None = None  # TSV, first column sample id
    target: str | None = None  # numeric metadata column to predict
    sequences: str | None = None  # FASTA id -> sequence, when observation ids are not sequences
    # pipeline
    rarefy_depth: int = 1000
    max_asvs: int = "${model.max_asvs}"  # type: ignore[assignment]  # keep the most abundant per sample
    val_fraction: float = 0.2


@dataclass
class DataloaderConfig:
    """torch DataLoader settings (`conf/dataloader/`)."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    non_blocking: bool = False


@dataclass
class TrainerConfig:
    """The training loop (`aamperf/trainer.py`)."""

    max_steps: int = 100
    batch_size: int = 8  # samples per optimizer step (UniFrac needs pairs: >= 2)
    grad_accum_steps: int = 1  # micro-batches per optimizer step; each has batch_size / grad_accum_steps
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    val_every: int = 50  # steps between validations (and one at the end)
    val_batches: int = 4  # batches per validation, so validation cost does not grow with data
    checkpoint_every: int = 0  # 0: no checkpoints
    resume: str = "disabled"  # disabled | auto
    progress: bool = True  # tqdm bar with loss and samples/s


@dataclass
class MetricsConfig:
    """What goes into metrics.jsonl and summary.json (`aamperf/metrics/`)."""

    log_every: int = 10  # steps between metrics.jsonl lines (host syncs happen only here)
    skip_steps: int = 3  # warm-up steps excluded from timing
    monitor_interval_s: float = 0.2  # psutil / pynvml sampling period (background thread)
    peak_flops_cache: str = "${data.cache_dir}/peak_flops.json"


@dataclass
class Config:
    """The whole run. `model` is open: any `_target_` returning an nn.Module, with its own kwargs."""

    data: DataConfig = field(default_factory=DataConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    model: Any = MISSING
    loss: Any = MISSING  # open like model: `_target_` + kwargs, called as loss(model, batch, step)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    optim: str = "baseline"  # the level's name, set by conf/optim/*.yaml
    precision: str = "fp32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
