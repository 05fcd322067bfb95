"""The schema of `python -m aamperf.predict` (conf/predict.yaml): which run, which samples, what to write."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from aamperf.config import register_configs


@dataclass
class PredictData:
    """The samples to predict for: the run's own data where every key is null; a new table with
    `data.table` (its metadata and target column to compare the predicted target with, its sequences
    where the observation ids are not sequences). Rarefaction and the ASV cut follow the run's."""

    table: str | None = None  # BIOM (HDF5 or JSON); its ASVs may be new: the model reads their sequences
    metadata: str | None = None  # TSV, first column the sample id
    target: str | None = None  # the column to compare predicted targets with (default: the run's column)
    sequences: str | None = None  # FASTA id -> sequence, when observation ids are not sequences


@dataclass
class PredictConfig:
    run: str = MISSING  # a completed run's directory: it holds model.pt
    data: PredictData = field(default_factory=PredictData)
    batch_size: int = 32  # samples per forward pass
    pairwise: bool = False  # also the predicted UniFrac between every pair of samples (unifrac.npy, n x n)
    export: bool = False  # also model.pt2: the model as a torch.export program (aamperf/predict/export.py)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    progress: bool = True  # tqdm bar with samples/s


def register_predict_configs() -> None:
    register_configs()  # the resolvers the run directory's name uses
    ConfigStore.instance().store(name="predict_schema", node=PredictConfig)
