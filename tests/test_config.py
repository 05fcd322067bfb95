"""Every option of every config group composes, and the schema refuses what it should."""

import re
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
OPTIONS = [(g, o.stem) for g in GROUPS for o in sorted((CONF_DIR / g).glob("*.yaml"))]


def test_the_groups_and_options_the_readme_lists_exist():
    """README "Config groups": each group of its table is in conf/, with exactly the options it names."""
    section = (CONF_DIR.parent / "README.md").read_text().split("## Config groups")[1].split("\n## ")[0]
    table = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|", section, re.MULTILINE))
    assert {"data", "model", "loss", "optim"} <= table.keys() and "dataloader" in GROUPS
    for group, options in table.items():
        named = set(re.findall(r"`(\w+)`", options))
        assert named == {o for g, o in OPTIONS if g == group}, group


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(make_cfg, group, option):
    cfg = make_cfg(f"{group}={option}", hydra=group == "hparams_search")  # it reads ${hydra:sweep.dir}
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # the job's config, as a run sees it
    OmegaConf.to_container(job, resolve=True)  # every interpolation resolves
    if group in ("model", "loss"):  # both are built from their _target_ and are modules the run calls
        built = instantiate(cfg[group])
        assert isinstance(built, torch.nn.Module) and callable(built)
        if group == "model":
            assert sum(p.numel() for p in built.parameters()) > 0


def test_model_presets_have_the_documented_sizes(make_cfg):
    base = make_cfg("model=aam_base").model
    assert (base.embedding_dim, base.num_heads, base.max_asvs) == (128, 4, 1024)
    assert base.asv_layers == base.sample_layers == base.encoder_layers == 4
    assert make_cfg("model=aam_base").data.max_asvs == 1024  # data follows the model's ASV budget


def test_default_run_is_the_baseline_on_simulated_data():
    from hydra import compose, initialize_config_dir

    from aamperf.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config")
    assert (cfg.optim, cfg.precision.dtype, cfg.data.source) == ("baseline", "fp32", "simulated")
    assert cfg.model._target_.endswith("AAM") and cfg.model.embedding_dim < 128


@pytest.mark.parametrize("override", ["trainer.max_step=5", "trainer.max_steps=many", "data.rarefy=10"])
def test_schema_refuses_unknown_keys_and_wrong_types(make_cfg, override):
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)


def test_conf_dir_is_the_one_the_entry_point_uses():
    import aamperf.train

    assert (Path(aamperf.train.__file__).parent / "../conf").resolve() == CONF_DIR
