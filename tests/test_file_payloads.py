"""No code from a file runs: a config read back from disk (a model file's, a checkpoint's, a run's record
read by compare and the search) names `_target_`s that would create a file if anything built them, and
the marker file must never appear. Each payload was one that ran on the code before the allow-list."""

import base64
import io
import json
import pickle
import re

import pytest
import torch
import yaml

from aamperf.errors import UserError
from aamperf.report import find_runs
from aamperf.run import train
from aamperf.search import FastestSearch
from aamperf.weights import FORMAT, MODEL_FILE, load_model


class TouchOnLoad:
    """Unpickled, it creates `path`: what a pickle payload does in place of os.system."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def payloads(marker) -> dict:
    """`_target_` configs that each create `marker` when instantiated."""
    buffer = io.BytesIO()
    torch.save(TouchOnLoad(marker), buffer)  # a torch file whose unpickling creates marker
    return {
        "torch.load": {
            "_target_": "torch.load",
            "weights_only": False,
            "f": {
                "_target_": "io.BytesIO",
                "initial_bytes": {
                    "_target_": "base64.b64decode",
                    "s": base64.b64encode(buffer.getvalue()).decode(),
                },
            },
        },
        "builtins.open": {"_target_": "builtins.open", "file": str(marker), "mode": "w"},
        "shutil.copyfile": {"_target_": "shutil.copyfile", "src": __file__, "dst": str(marker)},
        "os.makedirs": {"_target_": "os.makedirs", "name": str(marker)},
    }


def model_file(run_dir, model_config: dict) -> None:
    """A model.pt as aamperf writes it (readable with weights_only) whose config is `model_config`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "weights": {}, "config": {"model": model_config, "data": {}}, "target": None}
    torch.save(payload, run_dir / MODEL_FILE)


AAM = {"_target_": "aamperf.model.AAM", "embedding_dim": 8}


@pytest.mark.parametrize("name", ["torch.load", "builtins.open", "shutil.copyfile", "os.makedirs"])
@pytest.mark.parametrize("where", ["model", "nested", "in a list"])
def test_a_model_files_targets_are_not_built_unless_they_are_aamperfs(tmp_path, name, where):
    marker = tmp_path / "marker"
    payload = payloads(marker)[name]
    config = {
        "model": payload,
        "nested": {**AAM, "layers": payload},
        "in a list": {**AAM, "_args_": [payload]},
    }[where]
    model_file(tmp_path / "run", config)
    with pytest.raises(Exception) as caught:
        load_model(tmp_path / "run")
    assert not marker.exists()  # before the message: on the code before the allow-list, it ran
    assert caught.type is UserError
    assert re.search(rf"its model\S* {re.escape(name)} is not aamperf's model", str(caught.value))
    assert "\n" not in str(caught.value)


def test_an_interpolation_in_a_model_file_is_not_resolved_into_a_target(tmp_path):
    """oc.decode would turn a string into a `_target_` node after any check of the plain config."""
    marker = tmp_path / "marker"
    decoded = "${oc.decode:'{_target_: os.makedirs, name: " + str(marker) + "}'}"
    model_file(tmp_path / "run", {**AAM, "layers": decoded})
    with pytest.raises(UserError, match=r"model.layers holds an interpolation"):
        load_model(tmp_path / "run")
    assert not marker.exists()


def test_predict_builds_no_target_from_a_shared_model_file(launch_here, tmp_path):
    marker = tmp_path / "marker"
    model_file(tmp_path / "shared", {**AAM, "layers": payloads(marker)["os.makedirs"]})
    proc, out = launch_here(f"run={tmp_path / 'shared'}", name="p", module="aamperf.predict", tiny=False)
    assert not marker.exists()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "model.layers._target_ os.makedirs is not aamperf's model" in proc.stderr
    assert not marker.exists()
    assert not (out / "summary.json").exists()

    model_file(tmp_path / "plugin", payloads(marker)["builtins.open"])  # another model: predict says so
    proc, _ = launch_here(f"run={tmp_path / 'plugin'}", name="p2", module="aamperf.predict", tiny=False)
    assert proc.returncode == 2
    assert "trained builtins.open (model._target_), not AAM" in proc.stderr.strip().splitlines()[-1]
    assert not marker.exists()


def test_hydras_pickle_rerun_is_refused(launch, tmp_path):
    """--experimental-rerun unpickles the file it is given: refused before it is read. Each command in a
    process of its own (not launch_here): the exit code 2 a shell sees, through its process's end."""
    marker = tmp_path / "marker"
    (tmp_path / "config.pickle").write_bytes(pickle.dumps(TouchOnLoad(marker)))
    for module in ("aamperf.train", "aamperf.predict"):
        proc, _ = launch(
            "--experimental-rerun", str(tmp_path / "config.pickle"), name=None, module=module, tiny=False
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: --experimental-rerun")
        assert not marker.exists()


def test_a_resume_builds_nothing_from_its_checkpoints_config(make_cfg, tmp_path):
    cfg = make_cfg("trainer.checkpoint_every=1", "trainer.max_steps=2")
    train(cfg, tmp_path / "run")
    marker = tmp_path / "marker"
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step_*.pt"))[-1]
    saved = torch.load(newest, weights_only=True)
    saved["config"]["model"]["layers"] = payloads(marker)["os.makedirs"]
    torch.save(saved, newest)
    resumed = make_cfg("trainer.checkpoint_every=1", "trainer.max_steps=3", "trainer.resume=auto")
    with pytest.raises(UserError, match=r"cannot resume"):
        train(resumed, tmp_path / "run")
    assert not marker.exists()


def run_record(run_dir, marker, overrides_yaml: str | None = None) -> None:
    """A run directory whose summary, config and overrides carry payloads."""
    (run_dir / ".hydra").mkdir(parents=True)
    config = {"model": payloads(marker)["os.makedirs"], "optim": "baseline", "seed": 0}
    summary = {"status": "completed", "optim": "baseline", "samples_per_s": 10.0, "config": config}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    overrides = overrides_yaml or yaml.safe_dump(["optim=baseline", "+model._target_=os.makedirs"])
    (run_dir / ".hydra" / "overrides.yaml").write_text(overrides)


def test_compare_and_the_search_read_records_without_building_or_unpickling(tmp_path):
    marker = tmp_path / "marker"
    run_record(tmp_path / "sweep" / "0", marker)
    runs = find_runs([tmp_path / "sweep"])
    assert runs[0].overrides == ["optim=baseline", "+model._target_=os.makedirs"]  # read as text
    FastestSearch().write_level(_sweep_config(tmp_path / "sweep"))  # the best trial's overrides: text
    assert not marker.exists()

    # a YAML tag that constructs a Python object: a one-line refusal naming the file, nothing run
    tagged = f"- !!python/object/apply:os.makedirs ['{marker}']\n"
    run_record(tmp_path / "tagged" / "0", marker, tagged)
    with pytest.raises(UserError, match=r"overrides.yaml is not a run's overrides"):
        find_runs([tmp_path / "tagged"])
    assert not marker.exists()


def _sweep_config(sweep_dir):
    from omegaconf import OmegaConf

    hydra = {"sweep": {"dir": str(sweep_dir)}, "sweeper": {"params": {"optim": "choice(a)"}}}
    return OmegaConf.create({"hydra": hydra, "compare": {"quality_tolerance": 0.02}})
