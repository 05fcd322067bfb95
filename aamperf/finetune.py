"""AAM's stage 2: a run that starts from a pretrained run's weights (`init.from_run`, the original's
`--pretrained-encoder`), parts of them frozen (`finetune.freeze`, its `--freeze-base`).

The pretrained run's model.pt is read as data (weights_only): this run's own `model` config builds the model
and nothing of the file's config is instantiated. Its tensors go in by name and shape; the encoder must fit
whole (else one line naming the tensors and the model sizes that differ), and the heads stage 2 learns
(`FRESH`) keep this run's fresh initialization. Both run before any phase wraps the model, on every rank
alike; a resumed run then loads its own checkpoint over them (the checkpoint wins)."""

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from aamperf.config import CONF_DIR
from aamperf.errors import UserError
from aamperf.weights import MODEL_FILE, read_model_file

# Heads stage 2 trains from this run's initialization, whatever the file holds: AAM's stage 1 has no target,
# so its target head never learned one (AdamW leaves a parameter without gradients as initialized), and a
# pretraining that had one (aamperf's data.target) learned its own column, not this run's.
# The categorical conditioning (data.categorical) is of the target head: fresh with it.
# The count head (model.count_head) is fresh too: the original's pretraining has none.
FRESH = (
    "target_head", "target_encoder", "target_pool", "categorical_embeddings", "categorical_projection",
    "categorical_gate", "categorical_transform", "categorical_update", "categorical_norm", "output_scales",
    "output_biases", "count_encoder", "count_head",
)  # fmt: skip
# Model arguments a fine-tune may change; any other that differs from the file's changes what the loaded
# weights compute (num_heads splits the same tensors into other heads) and is refused.
CHANGEABLE = (
    "dropout", "target_dim", "target_head", "target_layers", "categorical_sizes", "categorical_fusion",
    "categorical_output_scaling", "categorical_dim", "count_head", "count_layers", "target_hidden_dims",
    "target_dropout", "target_residual",
)  # fmt: skip
# The modules (aamperf/model/aam.py) each `finetune.freeze` option keeps as pretrained.
ASV_LEVEL = ("token_embedding", "base_position", "asv_encoder", "asv_pool")
SAMPLE_LEVEL = (
    "count_embedding", "count_projection", "asv_position", "sample_transformer", "encoder_transformer",
    "sample_pool",
)  # fmt: skip
FROZEN = {"none": (), "asv_encoder": ASV_LEVEL, "encoder": ASV_LEVEL + SAMPLE_LEVEL}
# Frozen modules run in eval mode (dropout off). The original's --freeze-base only sets requires_grad=False
# (aam/models/sequence_predictor.py) and its Trainer's model.train() puts the frozen base back in train
# mode, dropout on. Off here: dropout in weights that never change teaches them nothing, it only adds noise
# to the embeddings the trained heads read; and a frozen encoder with dropout off gives each sample one
# embedding, which is what lets stage 2 compute it once (issue 42's cached-embedding path).
EVAL_REASON = (
    "frozen modules run in eval mode (dropout off): their weights do not change, so dropout there only adds "
    "noise to the embeddings the trained heads read, and without it a sample's embedding is fixed; the "
    "original's --freeze-base keeps dropout on in its frozen base (its model.train() reaches it)"
)


def fresh(name: str) -> bool:
    """Is `name` (a state-dict key) a tensor of a head that stage 2 trains from scratch?"""
    return name.split(".", 1)[0] in FRESH


def load_pretrained(model: nn.Module, cfg: DictConfig, summary: dict[str, Any]) -> None:
    """init.from_run: every tensor of the pretrained run's model.pt into `model` (built, on its device, not
    yet wrapped), the `FRESH` heads left as initialized; recorded in summary["finetune"]. The encoder must
    fit: a one-line UserError names the first tensors and the model sizes that differ."""
    if cfg.init.from_run is None:
        return
    run_dir = Path(cfg.init.from_run).expanduser()
    path = run_dir / MODEL_FILE
    if not path.is_file():
        missing = f"no {MODEL_FILE} in it" if run_dir.is_dir() else "no such directory"
        raise UserError(
            f"init.from_run={cfg.init.from_run}: {missing}; give the directory of a completed run (a run "
            "that stopped early keeps checkpoints: trainer.resume=auto in its directory completes it)"
        )
    payload = read_model_file(run_dir)  # weights_only: a file's pickled code is refused, not run
    theirs = payload.get("weights")
    if not isinstance(theirs, dict) or not all(isinstance(t, torch.Tensor) for t in theirs.values()):
        raise UserError(f"{path} holds no weights by name (not an aamperf model file); train the run again")
    ours, their_model = model.state_dict(), file_model_config(payload)
    misfits = misfit_tensors(theirs, ours)
    differences = size_differences(their_model, cfg)
    if misfits or set(differences) - {"_target_"}:  # the weights decide whose model they are, not its name
        raise UserError(misfit_message(cfg.init.from_run, misfits, differences, their_model))
    loaded = {name: tensor for name, tensor in theirs.items() if not fresh(name)}
    model.load_state_dict(loaded, strict=False)  # copies into the model's own tensors (device, dtype)
    summary.setdefault("finetune", {}).update(
        from_run=str(cfg.init.from_run),
        tensors_loaded=len(loaded),
        values_loaded=sum(t.numel() for t in loaded.values()),
        fresh=[name for name in ours if fresh(name)],
        fresh_reason=fresh_reason(payload.get("target")),
    )


def fresh_reason(pretrain_target: Any) -> str:
    """Why the target head starts fresh, from the pretraining's target record (None: it had no target)."""
    if isinstance(pretrain_target, dict):
        return (
            f"the pretraining's target head learned its column {pretrain_target.get('column')!r}; stage 2 "
            "learns its own target from this run's initialization"
        )
    return "the pretraining had no target (data.target=null): its target head never learned one"


def misfit_tensors(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> list[str]:
    """Each tensor outside the fresh heads that one model has and the other lacks, or has in another shape:
    `name [shape] there, [shape] here` (`-` where absent), this model's order first."""
    names = [*ours, *(name for name in theirs if name not in ours)]

    def shape(weights: dict[str, torch.Tensor], name: str) -> str:
        return str(list(weights[name].shape)) if name in weights else "-"

    return [
        f"{name} {shape(theirs, name)} there, {shape(ours, name)} here"
        for name in names
        if not fresh(name) and shape(theirs, name) != shape(ours, name)
    ]


def file_model_config(payload: dict[str, Any]) -> dict[str, Any]:
    """The model config a model file was trained with, as plain data ({} where it has none)."""
    config = payload.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, dict) else {}


def size_differences(theirs: dict[str, Any], cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """{argument: (the file's value, this run's)} for every argument of this run's `model` but `CHANGEABLE`
    whose value in the file's model config `theirs` differs ({} where the file has none). Arguments only the
    file's model has are not this run's model's: left out."""
    if not theirs:
        return {}
    ours = OmegaConf.to_container(cfg.model, resolve=True)
    return {
        key: (theirs.get(key), value)
        for key, value in ours.items()
        if key not in CHANGEABLE and theirs.get(key) != value
    }


def misfit_message(
    run: str, misfits: list[str], differences: dict[str, tuple[Any, Any]], their_model: dict[str, Any]
) -> str:
    """The refusal's one line: which sizes and tensors differ, and the overrides that build a model the file's
    weights fit (the conf/model/ option of the file's model, where one has all its sizes)."""
    where = f"init.from_run={run}"
    tensors = "; ".join(misfits[:3]) + (f"; ... ({len(misfits)} tensors)" if len(misfits) > 3 else "")
    seen = f" ({tensors})" if tensors else ""
    # sizes only: never a file's `_target_` or string (an interpolation) that would run as this run builds
    overrides = " ".join(
        f"model.{key}={shown(old)}"
        for key, (old, _) in differences.items()
        if old is None or isinstance(old, int | float)  # bool is an int
    )
    option = model_option(their_model)
    fixes = [f"model={option}"] * bool(option) + [overrides] * bool(overrides)
    # no size to give: no config to compare, or only its _target_ (or a string) differs
    fix = " or ".join(fixes) or "model.* as that run had them (its .hydra/config.yaml)"
    if not differences:
        return f"{where}: its weights do not fit this run's model{seen}: set {fix}"
    there = ", ".join(f"{key}={shown(old)}" for key, (old, _) in differences.items())
    here = ", ".join(f"{key}={shown(new)}" for key, (_, new) in differences.items())
    return f"{where}: its model has {there}, this run's {here}{seen}: set {fix}"


def shown(value: Any) -> str:
    """A config value as an override writes it, cut short (a file's value is anything it holds)."""
    text = "null" if value is None else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def model_option(their_model: dict[str, Any]) -> str | None:
    """The conf/model/ option whose arguments are the file's model's (but `CHANGEABLE`), or None. Read as
    YAML: data."""
    sizes = {key: value for key, value in their_model.items() if key not in CHANGEABLE}
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        option = OmegaConf.to_container(OmegaConf.load(path))
        if isinstance(option, dict) and {k: v for k, v in option.items() if k not in CHANGEABLE} == sizes:
            return path.stem
    return None


def freeze(model: nn.Module, cfg: DictConfig, summary: dict[str, Any] | None = None) -> list[str]:
    """finetune.freeze: the `FROZEN` modules of `model` keep their weights (requires_grad off: the optimizer,
    built from the trainable parameters, never holds them, weight decay included) and run in eval mode
    (`EVAL_REASON`). The names frozen; a fine-tune records them in summary["finetune"] with the counts of
    frozen and trainable parameters."""
    asked = str(cfg.finetune.freeze)
    frozen = frozen_modules(model, cfg) if asked != "none" else {}
    for module in frozen.values():
        module.requires_grad_(False)
        stay_in_eval(module)
    if summary is not None and (frozen or "finetune" in summary):
        summary.setdefault("finetune", {}).update(
            freeze=asked,
            frozen_modules=list(frozen),
            frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
            trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
            frozen_in_eval=bool(frozen),
            eval_reason=EVAL_REASON if frozen else None,
        )
    return list(frozen)


def frozen_modules(model: nn.Module, cfg: DictConfig) -> dict[str, nn.Module]:
    """The modules of `model` that finetune.freeze names (an AAM without a count embedding lacks one), or a
    one-line UserError where freezing would keep a fresh model's weights or the model has none of them."""
    asked = str(cfg.finetune.freeze)
    if cfg.init.from_run is None:
        raise UserError(
            f"finetune.freeze={asked} keeps weights as they are, and without init.from_run they are a fresh "
            f"model's: set init.from_run=<a pretrain run's directory>, or finetune.freeze=none"
        )
    modules = {name: getattr(model, name, None) for name in FROZEN[asked]}
    frozen = {name: module for name, module in modules.items() if isinstance(module, nn.Module)}
    if not frozen:
        raise UserError(
            f"finetune.freeze={asked} freezes AAM's modules ({', '.join(FROZEN[asked])}), and model "
            f"{cfg.model.get('_target_')} has none of them: set finetune.freeze=none"
        )
    return frozen


class StayInEval:
    """A frozen module's `train`: eval whatever mode is asked, so the loop's model.train() (after each
    validation) leaves its dropout off. An object, not a closure: a copy of the model gets its own."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, mode: bool = True) -> nn.Module:
        return nn.Module.train(self.module, False)


def stay_in_eval(module: nn.Module) -> None:
    """Put `module` in eval mode for good: model.train() on it, or on anything that holds it, keeps it so."""
    module.train = StayInEval(module)
    module.eval()
