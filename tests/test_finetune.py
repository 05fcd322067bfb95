"""Stage 2 (aamperf/finetune.py): a run started from a pretrained run's model.pt, its encoder frozen or not,
trained on a metadata target; the pretraining here is a real 3-step run of the tiny config, without one."""

import json

import pytest
import torch
from conftest import read_summary, weights_of
from hydra.utils import instantiate
from test_file_payloads import payloads

from aamperf.checkpoint import config_changes
from aamperf.errors import UserError
from aamperf.finetune import ASV_LEVEL, FROZEN, SAMPLE_LEVEL, freeze, load_pretrained
from aamperf.rng import seed_everything
from aamperf.run import train
from aamperf.weights import MODEL_FILE

# the metadata of the simulated data (aamperf/data/simulate.py): `target` is numeric
FINETUNE = ["data.target=target"]


def fresh_model(cfg) -> torch.nn.Module:
    """This run's model as build_model makes it before loading: seeded by `seed`."""
    seed_everything(cfg.seed)
    return instantiate(cfg.model)


def test_loaded_weights_are_the_pretrained_runs_and_the_target_head_fresh(make_cfg, pretrained):
    cfg = make_cfg(f"init.from_run={pretrained}", *FINETUNE, "seed=1")  # a target head unlike the file's
    model, summary, saved = fresh_model(cfg), {}, weights_of(pretrained)
    load_pretrained(model, cfg, summary)
    ours = model.state_dict()
    heads = ["target_head.weight", "target_head.bias"]
    assert set(ours) == set(saved) and all(torch.equal(ours[n], saved[n]) for n in saved if n not in heads)
    initial = fresh_model(cfg).state_dict()  # the target head as this run initializes it, not the file's
    assert all(torch.equal(ours[n], initial[n]) for n in heads)
    assert not torch.equal(ours[heads[0]], saved[heads[0]])  # another seed's weights (a bias starts at 0)
    record = summary["finetune"]
    assert record["from_run"] == str(pretrained) and record["fresh"] == heads
    assert record["tensors_loaded"] == len(saved) - 2 and "never learned one" in record["fresh_reason"]


@pytest.mark.parametrize("frozen", ["encoder", "asv_encoder"])
def test_frozen_parameters_keep_the_pretrained_values_and_the_others_train(
    make_cfg, pretrained, tmp_path, frozen
):
    frozen_run = [f"init.from_run={pretrained}", f"finetune.freeze={frozen}", "trainer.checkpoint_every=3"]
    summary = train(make_cfg(*frozen_run, *FINETUNE), tmp_path)
    assert summary["status"] == "completed"
    before, after = weights_of(pretrained), weights_of(tmp_path)
    is_frozen = {name: name.split(".")[0] in FROZEN[frozen] for name in after}
    kept = [name for name, f in is_frozen.items() if f]
    trained = [name for name, f in is_frozen.items() if not f]
    assert kept and all(torch.equal(after[name], before[name]) for name in kept)  # bit for bit
    # every trainable tensor moved (AdamW moves each by about lr a step)
    changed = [name for name in trained if not torch.equal(after[name], before[name])]
    assert changed == trained
    assert {"nuc_head.weight", "target_head.weight"} <= set(trained)
    # the optimizer holds the trainable tensors only: nothing it could decay or step among the frozen ones
    optimizer = torch.load(tmp_path / "checkpoints" / "step_00000003.pt", weights_only=True)["optimizer"]
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == len(trained)
    record = summary["finetune"]
    held = [name for name in FROZEN[frozen] if name != "count_projection"]  # count_embedding_method=concat's
    assert record["frozen_modules"] == held and record["frozen_in_eval"] is True
    assert record["frozen_params"] == sum(after[name].numel() for name in kept)
    assert record["trainable_params"] == sum(after[name].numel() for name in trained)
    assert json.loads((tmp_path / "summary.json").read_text())["finetune"] == record


def test_frozen_modules_stay_in_eval_mode_through_model_train(make_cfg, pretrained):
    """The loop calls model.train() after every validation: frozen modules keep their dropout off, so a
    frozen encoder gives a sample one embedding in training; the rest trains with dropout."""
    cfg = make_cfg(f"init.from_run={pretrained}", "finetune.freeze=asv_encoder", "model.dropout=0.5")
    model = fresh_model(cfg)
    load_pretrained(model, cfg, {})
    assert freeze(model, cfg) == list(ASV_LEVEL)
    model.eval()
    model.train()
    for name, module in model.named_modules():
        top = name.split(".")[0]
        if top:
            assert module.training == (top not in ASV_LEVEL), name
    tokens = torch.randint(1, 5, (2, 3, 151))
    counts = torch.ones(2, 3, 1)
    first, again = model(tokens, counts), model(tokens, counts)
    assert torch.equal(first["asv_embedding"], again["asv_embedding"])  # the frozen level: no dropout
    assert not torch.equal(first["sample_embedding"], again["sample_embedding"])  # the trained level: dropout

    cfg = make_cfg(f"init.from_run={pretrained}", "finetune.freeze=encoder", "model.dropout=0.5")
    model = fresh_model(cfg)
    freeze(model, cfg)
    model.train()
    assert torch.equal(model(tokens, counts)["sample_embedding"], model(tokens, counts)["sample_embedding"])
    held = [getattr(model, name) for name in ASV_LEVEL + SAMPLE_LEVEL if getattr(model, name) is not None]
    # every module but count_projection (count_embedding_method=concat's)
    assert len(held) == len(ASV_LEVEL + SAMPLE_LEVEL) - 1 and not any(m.training for m in held)


def test_freezing_without_a_pretrained_run_is_one_line(make_cfg, tmp_path):
    with pytest.raises(UserError) as refused:
        train(make_cfg("finetune.freeze=encoder"), tmp_path)
    assert str(refused.value) == (
        "finetune.freeze=encoder keeps weights as they are, and without init.from_run they are a fresh "
        "model's: set init.from_run=<a pretrain run's directory>, or finetune.freeze=none"
    )


def test_another_model_size_is_refused_in_one_line_and_writes_no_more_than_a_refused_run(
    launch_here, pretrained
):
    proc, run_dir = launch_here(f"init.from_run={pretrained}", "model.embedding_dim=48", name="finetune")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1] == (
        f"error: init.from_run={pretrained}: its model has embedding_dim=32, this run's embedding_dim=48 "
        "(token_embedding.weight [7, 32] there, [7, 48] here; base_position.weight [151, 32] there, "
        "[151, 48] here; asv_encoder.blocks.0.ln_attn.weight [32] there, [48] here; ... (54 tensors)): "
        "set model=aam_tiny or model.embedding_dim=32"
    )
    assert not any("error" in line.lower() for line in lines[:-1])
    refused, reference = launch_here("data.target=bmi", name="reference")  # a start refused by its data
    assert refused.returncode == 2

    def files(directory):
        return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())

    assert files(run_dir) == files(reference)  # no model.pt, no metrics, no checkpoint
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["error"] == lines[-1].removeprefix("error: ")


def test_a_missing_pretrained_run_is_one_line(make_cfg, tmp_path):
    with pytest.raises(
        UserError, match=r"^init.from_run=\S+nope: no such directory; give the directory of a"
    ):
        train(make_cfg(f"init.from_run={tmp_path / 'nope'}"), tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: no model.pt in it; give the directory of a completed run"):
        train(make_cfg(f"init.from_run={tmp_path / 'empty'}"), tmp_path / "run2")


def test_a_model_files_harmful_target_is_never_built(make_cfg, pretrained, tmp_path):
    """The file's config names code that creates a file if built: its weights load, nothing of it runs."""
    marker, shared = tmp_path / "marker", tmp_path / "shared"
    shared.mkdir()
    payload = torch.load(pretrained / MODEL_FILE, weights_only=True)
    harmful = payloads(marker)
    model = payload["config"]["model"]
    payload["config"]["model"] = {**model, **harmful["builtins.open"], "layers": harmful["torch.load"]}
    torch.save(payload, shared / MODEL_FILE)
    cfg = make_cfg(f"init.from_run={shared}", "finetune.freeze=encoder", *FINETUNE)
    summary = train(cfg, tmp_path / "run")
    assert not marker.exists()
    assert (
        summary["status"] == "completed"
        and summary["finetune"]["tensors_loaded"] == len(payload["weights"]) - 2
    )
    after = weights_of(tmp_path / "run")
    frozen = [name for name in after if name.split(".")[0] in FROZEN["encoder"]]
    assert all(torch.equal(after[name], payload["weights"][name]) for name in frozen)
    # a model that does not fit: the refusal names sizes to set, never the file's _target_ to build
    with pytest.raises(UserError) as refused:
        train(make_cfg(f"init.from_run={shared}", "model.embedding_dim=48"), tmp_path / "refused")
    assert "model._target_" not in str(refused.value) and str(refused.value).endswith(
        ": set model.embedding_dim=32"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "weights", [["loss.unifrac_weight=0", "loss.nucleotide_weight=0"], []], ids=["target only", "all three"]
)
def test_a_fine_tune_learns_a_target_the_pretraining_had_not(make_cfg, pretrained, tmp_path, weights):
    summary = train(make_cfg(f"init.from_run={pretrained}", *FINETUNE, *weights), tmp_path)
    assert summary["status"] == "completed" and summary["finetune"]["from_run"] == str(pretrained)
    val = summary["val"]
    assert summary["target"]["column"] == "target" and val["val_target"] > 0
    trained_on = val["val_target"] + (val["val_unifrac"] + val["val_nucleotide"] if weights == [] else 0.0)
    assert val["val_loss"] == pytest.approx(trained_on, rel=1e-5)


def test_a_resumed_fine_tune_goes_on_from_its_checkpoint(make_cfg, pretrained, tmp_path):
    """The checkpoint's weights win over the pretrained ones: going on from step 1 ends where the whole
    run ended, bit for bit."""
    resumable = ["trainer.max_steps=2", "trainer.checkpoint_every=1", "trainer.resume=auto"]
    cfg = make_cfg(f"init.from_run={pretrained}", *FINETUNE, *resumable)
    assert train(cfg, tmp_path)["status"] == "completed"
    whole = weights_of(tmp_path)
    (tmp_path / "checkpoints" / "step_00000002.pt").unlink()
    summary = train(make_cfg(f"init.from_run={pretrained}", *FINETUNE, *resumable), tmp_path)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 1
    resumed = weights_of(tmp_path)
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)
    # what trains is part of the run: a resume that would freeze the encoder now is refused in one line
    (tmp_path / "checkpoints" / "step_00000002.pt").unlink()
    frozen = make_cfg(f"init.from_run={pretrained}", *FINETUNE, *resumable, "finetune.freeze=encoder")
    with pytest.raises(
        UserError, match=r"^cannot resume from .* with finetune\.freeze=encoder \(checkpoint: none\)"
    ):
        train(frozen, tmp_path)
    assert torch.equal(weights_of(tmp_path)[name := next(iter(whole))], resumed[name])  # nothing written


def test_a_checkpoint_from_before_fine_tuning_resumes_as_unfrozen():
    """A checkpoint of a version without finetune.freeze trained everything: the same as `none`."""
    assert config_changes({"seed": 0}, {"seed": 0, "finetune": {"freeze": "none"}}) == {}
    assert list(config_changes({"seed": 0}, {"seed": 0, "finetune": {"freeze": "encoder"}})) == [
        "finetune.freeze"
    ]


def test_a_plug_in_model_fine_tunes_by_name_and_shape(make_cfg, tmp_path):
    """Any nn.Module: its tensors load by name and shape as AAM's do; a size that differs is named, and
    freezing AAM's modules is refused for a model that has none."""
    plugin = ["~model", "+model._target_=plugin_model.MeanPoolModel", "+model.dim=8", "data.max_asvs=16"]
    plugin += ["~loss", "+loss._target_=plugin_model.pair_loss", "+loss._partial_=true", "data.target=null"]
    assert train(make_cfg(*plugin), tmp_path / "pretrain")["status"] == "completed"
    from_run = f"init.from_run={tmp_path / 'pretrain'}"
    summary = train(make_cfg(*plugin, from_run, "trainer.max_steps=1"), tmp_path / "finetune")
    assert summary["status"] == "completed" and summary["finetune"]["tensors_loaded"] == 3
    assert summary["finetune"]["fresh"] == [] and summary["finetune"]["frozen_params"] == 0
    wider = [p.replace("dim=8", "dim=16") for p in plugin]
    with pytest.raises(UserError) as refused:
        train(make_cfg(*wider, from_run), tmp_path / "wider")
    assert str(refused.value) == (
        f"init.from_run={tmp_path / 'pretrain'}: its model has dim=8, this run's dim=16 (embed.weight [7, 8] "
        "there, [7, 16] here; proj.weight [8, 8] there, [16, 16] here; proj.bias [8] there, [16] here): set "
        "model.dim=8"
    )
    with pytest.raises(UserError, match=r"has none of them: set finetune.freeze=none$"):
        train(make_cfg(*plugin, from_run, "finetune.freeze=encoder"), tmp_path / "frozen")
