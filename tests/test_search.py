"""hparams_search=fastest: the Optuna search end to end on aam_tiny, and its quality bar."""

import json

import pytest
import yaml
from conftest import CONF_DIR, read_summary, torchrun
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from aamperf.config import register_configs
from aamperf.report import find_runs
from aamperf.search import level_yaml, objective, reference_overrides, searched_keys


def test_a_trial_that_loses_quality_scores_zero(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"val_loss": 2.0}))
    cfg = OmegaConf.create(
        {"search": {"reference": str(tmp_path / "summary.json")}, "compare": {"quality_tolerance": 0.02}}
    )
    assert objective(cfg, {"samples_per_s": 50.0, "val_loss": 2.039}) == 50.0  # +1.95%: within 2%
    assert objective(cfg, {"samples_per_s": 50.0, "val_loss": 2.05}) == 0.0  # +2.5%: not the same training
    assert objective(cfg, {"samples_per_s": 50.0, "val_loss": None}) == 0.0  # no validation: not counted


def test_a_trial_validated_in_batches_of_another_size_scores_zero(tmp_path, capsys):
    """The UniFrac part of a val loss is over the pairs inside a validation batch: a batch-16 trial validated
    in batches of 16 read +2.9% against the batch-8 reference and scored 0 for a val loss that did not
    compare (2026-11-29); hparams_search=fastest validates every run in batches of 8."""
    (tmp_path / "summary.json").write_text(json.dumps({"val_loss": 2.0, "val_batch_size": 8}))
    cfg = OmegaConf.create(
        {"search": {"reference": str(tmp_path / "summary.json")}, "compare": {"quality_tolerance": 0.02}}
    )
    trial = {"samples_per_s": 50.0, "val_loss": 1.9, "val_batch_size": 16}
    assert objective(cfg, trial) == 0.0
    assert "validated in batches of 16 against the reference's 8" in capsys.readouterr().err
    assert objective(cfg, {**trial, "val_batch_size": 8}) == 50.0
    no_unifrac = {"loss": {"unifrac_weight": 0.0}}  # no pairs in its val loss: any batch compares
    assert objective(cfg, {**trial, "config": no_unifrac}) == 50.0
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        composed = compose("config", overrides=["hparams_search=fastest", "trainer.batch_size=16"])
    assert composed.trainer.val_batch_size == 8


def test_the_reference_has_each_value_the_search_fixes():
    """A param given one value (a plain value, or the space narrowed the Optuna sweeper's way to a
    `choice` of one, on the command line or in hydra.sweeper.params) has it in the reference as in every
    trial; a param still searched is left to optim=baseline. Once `compile=choice(disabled)` reached the
    reference as written, which a single run refuses ("requires --multirun"), and the trials then went
    unchecked."""
    params = yaml.safe_load((CONF_DIR / "hparams_search" / "fastest.yaml").read_text())["hydra"]["sweeper"]
    params = {**params["params"], "memory": "none"}  # hydra.sweeper.params.memory=none
    task = [
        "hparams_search=fastest",
        "model=aam_tiny",
        "compile=choice(disabled)",  # narrowed to one value: fixed
        "attention=choice(math,sdpa)",  # narrowed to two: still searched
        "optim=ultra",  # the reference is optim=baseline
        "trainer.batch_size=choice(8)",
        "trainer.batch_size=16",  # a plain value wins over a search of the same key, as in the sweeper
    ]
    fixed = ["memory=none", "model=aam_tiny", "trainer.batch_size=16", "compile=disabled"]
    assert reference_overrides(params, task) == fixed


def test_the_level_written_holds_every_searched_key_the_command_line_ones_too():
    """A sweep on the command line (`'trainer.batch_size=choice(8,16)'`) is searched as the sweeper's params
    are: the best trial's value goes in optim/fastest.yaml; a plain value and Hydra's own settings do not."""
    params = {"compile": "choice(disabled,default)"}
    task = [
        "hparams_search=fastest",
        "trainer.batch_size=choice(8,16)",
        "trainer.max_steps=5",
        "hydra.job.chdir=false",
    ]
    keys = searched_keys(params, task)
    assert keys == ["compile", "hparams_search", "trainer.batch_size"] or keys == [
        "compile",
        "trainer.batch_size",
    ]
    level = yaml.safe_load(
        level_yaml(["compile=default", "trainer.batch_size=16", "trainer.max_steps=5"], keys, "n")
    )
    assert level["trainer"] == {"batch_size": 16} and level["defaults"] == [{"override /compile": "default"}]


@pytest.mark.slow  # 30.2 s on a 2-core AMD EPYC with AVX-512 (2026-11-27)
def test_a_narrowed_search_runs_its_reference_and_trials_with_the_fixed_values(launch):
    proc, sweep_dir = launch(
        "hparams_search=fastest",
        "hydra.sweeper.n_trials=2",
        "compile=choice(disabled)",  # the Optuna sweeper's way on the command line
        "hydra.sweeper.params.memory=none",  # ... and in its params (optim=baseline recomputes: full)
        name="search",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = find_runs([sweep_dir])
    assert len(runs) == 3  # the reference and 2 trials
    for run in runs:
        config = run.summary["config"]
        assert (run.summary["status"], config["compile"]["mode"], config["memory"]["checkpointing"]) == (
            "completed",
            "disabled",
            "none",
        ), run.path
        # validated alike, the reference too (in batches of 8, at most the 5 validation samples here), not in
        # its training batches of 4
        assert (config["trainer"]["val_batch_size"], run.summary["val_batch_size"]) == (8, 5), run.path
    assert read_summary(sweep_dir / "reference")["optim"] == "baseline"


def test_a_reference_that_fails_stops_the_search_before_its_trials(launch):
    """Without the reference's val loss no trial's quality can be checked: once, the search printed a
    warning and went on, each trial scored on its speed alone."""
    options = ["hparams_search=fastest", "hydra.sweeper.n_trials=2", "memory=choice(nosuch)"]  # misspelled
    proc, sweep_dir = launch(*options, name="search", multirun=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]  # the reference's: bad input
    lines = proc.stderr.strip().splitlines()
    assert any(line.startswith("error: ") and "nosuch" in line for line in lines[:-1])  # the reference's own
    assert lines[-1].startswith(
        "error: the search's reference run failed (exit code 2; its own error is above"
    )
    assert not sweep_dir.exists()  # no trial ran


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_search_runs_trials_and_writes_a_ready_optim_level(launch):
    proc, sweep_dir = launch(
        "hparams_search=fastest",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.params.compile=disabled",  # compiling each trial would take minutes here
        name="search",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = read_summary(sweep_dir / "reference")
    assert reference["optim"] == "baseline" and reference["status"] == "completed"
    trials = [r for r in find_runs([sweep_dir]) if r.path.name != "reference"]
    assert len(trials) == 3
    feasible = [r for r in trials if r.summary["val_loss"] <= reference["val_loss"] * 1.02]
    best = max(feasible, key=lambda r: r.summary["samples_per_s"])
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(best.summary["samples_per_s"])  # Optuna saw our objective

    # The level composes to the same config as the best trial's own choices on the command line.
    searched = yaml.safe_load((CONF_DIR / "hparams_search" / "fastest.yaml").read_text())["hydra"]["sweeper"]
    chosen = [o for o in best.overrides if o.split("=")[0] in searched["params"]]  # fixed ones included
    assert {f"{k}={v}" for k, v in results["best_params"].items()} <= set(chosen)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        level = compose("config", overrides=["optim=fastest", f"hydra.searchpath=[file://{sweep_dir}]"])
        trial = compose("config", overrides=chosen)
    assert level.optim == "fastest"
    level.optim = trial.optim
    assert level == trial
    # ... and trains as its header says: python -m aamperf.train optim=fastest 'hydra.searchpath=[...]'
    used, run_dir = launch("optim=fastest", f"hydra.searchpath=[file://{sweep_dir}]", name="level")
    assert used.returncode == 0, used.stderr[-3000:]  # not refused as "optim=fastest: no such option"
    assert read_summary(run_dir)["optim"] == "fastest"
    assert (sweep_dir / "comparison.md").exists()  # the usual report, reference as the baseline
    assert json.loads((sweep_dir / "comparison.json").read_text())["baseline"] == "optim=baseline"


@pytest.mark.slow  # ~6 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_the_search_under_torchrun_is_refused_before_anything_runs(launch):
    """Each rank would run an Optuna study of its own (and a reference run in torchrun's environment):
    once, the ranks failed to connect and then waited 6 minutes for each other."""
    launcher = torchrun(2, module="aamperf.launch")
    options = ["hparams_search=fastest", "distributed=ddp", "hydra.sweeper.n_trials=2"]
    proc, sweep_dir = launch(*options, name="search", launcher=launcher, multirun=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: hparams_search=fastest runs in one process (its trials timed one at a time")
    )
    assert not sweep_dir.exists()
