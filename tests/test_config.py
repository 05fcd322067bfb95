"""Every option of every config group composes, and the schema refuses what it should."""

import dataclasses
import functools
import re
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aamperf.config import Config
from aamperf.errors import hydra_error_message
from aamperf.model import AAM, AAMLoss

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
PREDICT_ONLY = ("inference", "quantize")  # groups of conf/predict.yaml (python -m aamperf.predict) alone
ALL_OPTIONS = [(g, o.stem) for g in GROUPS for o in sorted((CONF_DIR / g).glob("*.yaml"))]
OPTIONS = [(g, o) for g, o in ALL_OPTIONS if g not in PREDICT_ONLY]
PREDICT_OPTIONS = [(g, o) for g, o in ALL_OPTIONS if g in PREDICT_ONLY]


def choice_fields(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, type[Enum], bool]]:
    """Every closed choice of the schema: (key, its enum, whether the key holds a list of them)."""
    for f in dataclasses.fields(schema):
        element = next(iter(typing.get_args(f.type)), None)
        optional = type(None) in typing.get_args(f.type)  # `Enum | None`: one value, or null
        if dataclasses.is_dataclass(f.type):
            yield from choice_fields(f.type, f"{prefix}{f.name}.")
        elif isinstance(f.type, type) and issubclass(f.type, Enum):
            yield f"{prefix}{f.name}", f.type, False
        elif isinstance(element, type) and issubclass(element, Enum):
            yield f"{prefix}{f.name}", element, not optional


CHOICES = list(choice_fields())


def test_the_configuration_page_lists_every_group_and_its_options():
    """docs/configuration.md "Config groups": every group of conf/ in its table, with exactly its options."""
    page = (CONF_DIR.parent / "docs" / "configuration.md").read_text()
    section = page.split("## Config groups")[1].split("\n## ")[0]
    table = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|", section, re.MULTILINE))
    assert table.keys() == {g for g, _ in ALL_OPTIONS}, "the table names every config group, and only those"
    for group, options in table.items():
        named = set(re.findall(r"`(\w+)`", options))
        assert named == {o for g, o in ALL_OPTIONS if g == group}, group


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


def test_choices_are_enums_of_the_schema():
    keys = {key for key, _, _ in CHOICES}
    assert {"data.source", "precision.dtype", "compile.mode", "attention.backends", "logger.mode"} <= keys
    assert {"device", "compile.backend", "trainer.batch_size", "dataloader.num_workers"}.isdisjoint(keys)


@pytest.mark.parametrize(("key", "choice", "is_list"), CHOICES, ids=[key for key, _, _ in CHOICES])
def test_a_value_outside_a_choice_is_refused_at_compose_time(make_cfg, key, choice, is_list):
    with pytest.raises(ConfigCompositionException) as refused:
        make_cfg(f"{key}=[no_such_choice]" if is_list else f"{key}=no_such_choice")
    message = hydra_error_message(refused.value)
    assert message.startswith(f"{key}: no_such_choice" if is_list else f"{key}=no_such_choice")
    assert f" is not one of {', '.join(choice)}; set {key}=" in message


def test_choices_with_a_torch_counterpart_have_one_each():
    from aamperf.config import Dtype, SdpaBackend
    from aamperf.metrics.flops import DTYPES
    from aamperf.phases.attention import BACKENDS

    assert set(BACKENDS) == set(SdpaBackend) and set(DTYPES) == set(Dtype) - {"auto"}


def test_every_choice_is_accepted_and_reads_as_its_string():
    cfg = OmegaConf.structured(Config)
    for key, choice, is_list in CHOICES:
        for member in choice:
            expected = [member.value] if is_list else member.value
            OmegaConf.update(cfg, key, expected)  # a string, as the command line and YAML give it
            value = OmegaConf.select(cfg, key)
            assert (list(value) if is_list else value) == expected and f"{member}" == member.value
            # what goes to summary.json, W&B and checkpoints: plain strings, no enum class
            container = OmegaConf.to_container(cfg, enum_to_str=True)
            plain = functools.reduce(dict.__getitem__, key.split("."), container)
            assert plain == expected and type(plain[0] if is_list else plain) is str


def default_valued_keys(node: dict, schema: type, prefix: str = "") -> Iterator[str]:
    """The keys of an option file's `node` that set the default of `schema` (a dataclass) again."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in node.items():
        f = fields.get(key)
        if f is None:  # `defaults`, `hydra`, or a key the schema refuses (test_every_option_composes)
            continue
        if dataclasses.is_dataclass(f.type):
            yield from default_valued_keys(value or {}, f.type, f"{prefix}{key}.")
        elif value == (f.default_factory() if f.default is dataclasses.MISSING else f.default):
            yield f"{prefix}{key}"


@pytest.mark.parametrize(("group", "option"), PREDICT_OPTIONS, ids=[f"{g}={o}" for g, o in PREDICT_OPTIONS])
def test_every_predict_option_composes(group, option):
    from hydra import compose, initialize_config_dir

    from aamperf.predict.config import register_predict_configs

    register_predict_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", overrides=["run=x", f"{group}={option}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg.inference == (option if group == "inference" else "baseline")
    assert cfg.quantize.mode == ("int8_dynamic" if "int8" in option else "none")


def test_option_files_hold_only_what_differs_from_the_schema_defaults():
    from aamperf.predict.config import PredictConfig

    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    sections.update({f.name: f.type for f in dataclasses.fields(PredictConfig)})
    repeated = []
    for path in [CONF_DIR / "config.yaml", *(CONF_DIR / g / f"{o}.yaml" for g, o in ALL_OPTIONS)]:
        package_global = path.name == "config.yaml" or "# @package _global_" in path.read_text()
        predict_level = path.parent.name in PREDICT_ONLY
        schema = (
            (PredictConfig if predict_level else Config) if package_global else sections.get(path.parent.name)
        )
        if dataclasses.is_dataclass(schema):  # model and loss are open: their _target_'s arguments
            node = OmegaConf.to_container(OmegaConf.load(path)) or {}
            repeated += [f"{path.relative_to(CONF_DIR)}: {key}" for key in default_valued_keys(node, schema)]
    assert repeated == []  # each default lives in aamperf/config.py only


def test_conf_dir_is_the_one_the_entry_point_uses():
    import aamperf.train

    assert (Path(aamperf.train.__file__).parent / "../conf").resolve() == CONF_DIR


def test_aam_and_its_loss_refuse_arguments_they_cannot_train_with_as_they_are_built():
    """Built without check_config (a script, a plug-in subclass): every problem in one ValueError."""
    sizes = {"num_heads": 2, "asv_layers": 1, "sample_layers": 1, "encoder_layers": -1, "max_asvs": 16}
    with pytest.raises(ValueError) as refused:
        AAM(embedding_dim=0, ffn_mult=2.5, dropout=1.0, **sizes)
    assert str(refused.value) == (
        "embedding_dim=0 must be an integer >= 1; encoder_layers=-1 must be an integer >= 0; ffn_mult=2.5 "
        "must be an integer >= 1; dropout=1.0 must be a number in [0, 1)"
    )
    with pytest.raises(ValueError, match=r"^embedding_dim=30 is not divisible by num_heads=4$"):
        AAM(embedding_dim=30, **{**sizes, "num_heads": 4, "encoder_layers": 1})
    with pytest.raises(ValueError) as refused:
        AAMLoss(nucleotide_weight=-0.5, mask_fraction=1)
    assert str(refused.value) == (
        "nucleotide_weight=-0.5 must be a number >= 0; mask_fraction=1 must be a number between 0 and 1 "
        "(the share of real bases hidden and predicted)"
    )
