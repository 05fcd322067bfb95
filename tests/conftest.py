"""Fixtures: the real Hydra config, composed with tiny CPU settings."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aamperf.config import register_configs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Small enough for a 3-step run in a few seconds, big enough for every code path.
TINY = [
    "model=aam_tiny",
    "device=cpu",
    "data.n_samples=40",
    "data.n_asvs=64",
    "data.mean_richness=20",
    "data.depth=600",
    "data.rarefy_depth=500",
    "trainer.batch_size=4",
    "trainer.max_steps=3",
    "trainer.warmup_steps=1",
    "trainer.val_every=2",
    "trainer.val_batches=1",
    "trainer.progress=false",
    "metrics.log_every=1",
    "metrics.skip_steps=1",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the whole session: the tiny data set is simulated once."""
    return tmp_path_factory.mktemp("aamperf-cache")


@pytest.fixture
def make_cfg(cache_dir: Path) -> Iterator[Callable[..., DictConfig]]:
    """compose("config") with the tiny settings, then the test's own overrides (which win)."""
    register_configs()

    def make(*overrides: str, hydra: bool = False) -> DictConfig:
        """hydra=True: with the `hydra` node, set as the current HydraConfig (for ${hydra:...})."""
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(
                "config",
                overrides=[*TINY, f"data.cache_dir={cache_dir}", *overrides],
                return_hydra_config=hydra,
            )
        if hydra:
            HydraConfig.instance().set_config(cfg)
        return cfg

    yield make
    HydraConfig.instance().cfg = None  # no HydraConfig left behind for the next test
