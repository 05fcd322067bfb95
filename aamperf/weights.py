"""The model a completed run keeps: `<run dir>/model.pt`, its weights (plain names, whatever wrapped the
model while training: DDP, FSDP2, compile, recomputed blocks), the config it was built from and the
target's scale, readable with `torch.load(weights_only=True)`. `load_model` builds it back.

A model file is data: reading it runs no code (weights_only), and neither does building its model. Hydra's
`instantiate` calls whatever a `_target_` names (torch.load without weights_only, open(..., "w"), shutil,
os.system), so a `_target_` from the file is built only when it is aamperf's own model (`OWN_MODELS`) or one
the caller names again (`trust`, what the user says on the command line), at every depth of the config."""

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aamperf.distributed import rank
from aamperf.errors import UserError, one_line
from aamperf.files import write_atomic

MODEL_FILE = "model.pt"
FORMAT = 1
# The `_target_`s a model file may name without being named again: aamperf's own model classes.
OWN_MODELS = frozenset({"aamperf.model.AAM", "aamperf.model.aam.AAM"})
OWN_LOSSES = frozenset({"aamperf.model.AAMLoss", "aamperf.model.loss.AAMLoss"})  # and the loss's


def full_weights(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's whole weights, a copy on the CPU, on rank 0 (every rank calls this: FSDP2 gathers its
    shards); None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)  # names without the wrappers' prefixes
    if rank() != 0:
        return None
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}


def save_model(
    run_dir: Path,
    weights: dict[str, torch.Tensor] | None,
    config: dict[str, Any],
    target: dict | None,
    categorical: dict | None = None,
) -> Path | None:
    """Write the trained model, its `full_weights` (rank 0 writes; the others hold None); the path, on
    rank 0. `categorical`: data.categorical's record (columns, vocabularies), plain data."""
    if rank() != 0:
        return None
    payload = {
        "format": FORMAT,
        "weights": weights,
        "config": config,  # resolved: model, loss and data as trained
        "target": target,  # the target column's mean and std (predictions in its own units), or None
        # the categorical columns' vocabularies (aamperf/data/categorical.py): predict maps a new table's
        # categories with them; None where the model is not conditioned
        "categorical": categorical,
    }
    path = Path(run_dir) / MODEL_FILE
    write_atomic(path, lambda f: torch.save(payload, f), "free space there, or set hydra.run.dir elsewhere")
    return path


def read_model_file(run_dir: Path) -> dict[str, Any]:
    """The payload of `<run_dir>/model.pt`, or a one-line error that says what is wrong with it."""
    path = Path(run_dir) / MODEL_FILE
    if not path.is_file():
        raise UserError(
            f"run={run_dir} has no {MODEL_FILE}: only a completed run keeps its model (a run that stopped "
            "early keeps checkpoints: trainer.resume=auto in that directory completes it)"
        )
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated, not a torch file, or pickled code refused by weights_only
        raise UserError(f"{path} is not a model file aamperf can read: {one_line(exc)[:200]}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not an aamperf model file (format {FORMAT}); train the run again")
    return payload


def leaves(node: Any, where: str = "model") -> Iterator[tuple[str, Any]]:
    """(full key, value) of every value in a plain config value, nested dicts and lists included."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{where}.{key}")
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from leaves(value, f"{where}[{index}]")
    else:
        yield where, node


def model_config(payload: dict[str, Any], path: Path, trust: Iterable[str] = ()) -> dict[str, Any]:
    """The model config of a model file, once every `_target_` in it is aamperf's own model or named in
    `trust`; else a one-line error naming the first other one (nothing of it is imported or called)."""
    config = payload.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or "_target_" not in model:
        raise UserError(f"{path} holds no model config with a _target_; train the run again")
    allowed = OWN_MODELS | set(trust)
    for key, value in leaves(model):
        # saved resolved: an interpolation is not aamperf's, and instantiate would resolve it into new
        # nodes (oc.decode makes a `_target_` from a string) after this check
        if isinstance(value, str) and "${" in value:
            raise UserError(
                f"{path}: its {key} holds an interpolation ({value[:80]!r}), which aamperf never saves in a "
                "model file (its config is saved resolved); it is not built: train the run again"
            )
        if key.rpartition(".")[2] == "_target_" and not (isinstance(value, str) and value in allowed):
            named = value if isinstance(value, str) else repr(value)[:80]
            raise UserError(
                f"{path}: its {key} {named} is not aamperf's model, and a model file's config builds "
                f"only aamperf's models (building another runs its code); if you trust the file and "
                f"{named} is your plug-in model, name it: load_model(run_dir, trust=[{named!r}])"
            )
    return model


def load_model(
    run_dir: Path, device: torch.device | str = "cpu", trust: Iterable[str] = ()
) -> tuple[nn.Module, dict[str, Any]]:
    """The run's trained model, built from its config and given its weights, in eval mode on `device`;
    and the payload (config, target). `trust`: `_target_`s besides aamperf's own model that its config
    may build (a plug-in model of yours, named again here); any other is refused before it is imported."""
    payload = read_model_file(run_dir)
    return build_model(payload, Path(run_dir) / MODEL_FILE, device, trust), payload


def build_model(
    payload: dict[str, Any], path: Path, device: torch.device | str = "cpu", trust: Iterable[str] = ()
) -> nn.Module:
    """The model of a model file's payload (read_model_file), with its weights, in eval mode on `device`."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    model_cfg = model_config(payload, path, trust)
    try:
        model = instantiate(model_cfg)
    except InstantiationException as exc:  # a plug-in model whose module does not import here
        raise UserError(
            f"{path}: its model {model_cfg['_target_']} cannot be built here "
            f"({one_line(exc.__cause__ or exc)[:200]}); run where its module imports (on PYTHONPATH)"
        ) from exc
    if not isinstance(model, nn.Module):
        built = type(model).__name__
        raise UserError(f"{path}: its model {model_cfg['_target_']} builds a {built}, not a torch module")
    try:
        model.load_state_dict(payload["weights"])
    except RuntimeError as exc:
        raise UserError(
            f"{path}: its weights do not fit the model its config builds ({one_line(exc)[:200]})"
        ) from exc
    return model.to(device).eval()
