"""The model a completed run keeps: `<run dir>/model.pt`, its weights (plain names, whatever wrapped the
model while training: DDP, FSDP2, compile, recomputed blocks), the config it was built from and the
target's scale, readable with `torch.load(weights_only=True)`. `load_model` builds it back."""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from aamperf.distributed import rank
from aamperf.errors import UserError, one_line
from aamperf.files import write_atomic

MODEL_FILE = "model.pt"
FORMAT = 1


def save_model(run_dir: Path, model: nn.Module, config: dict[str, Any], target: dict | None) -> Path | None:
    """Write the trained model (every rank calls this: FSDP2 gathers the full weights; rank 0 writes);
    the path, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)  # names without the wrappers' prefixes
    if rank() != 0:
        return None
    payload = {
        "format": FORMAT,
        "weights": {name: tensor.detach().cpu() for name, tensor in weights.items()},
        "config": config,  # resolved: model, loss and data as trained
        "target": target,  # the target column's mean and std (predictions in its own units), or None
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


def load_model(run_dir: Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The run's trained model, built from its config and given its weights, in eval mode on `device`;
    and the payload (config, target)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    payload = read_model_file(run_dir)
    try:
        model = instantiate(payload["config"]["model"])
    except InstantiationException as exc:  # a plug-in model whose module does not import here
        target = payload["config"]["model"].get("_target_")
        raise UserError(
            f"{Path(run_dir) / MODEL_FILE}: its model {target} cannot be built here "
            f"({one_line(exc.__cause__ or exc)[:200]}); run where its module imports (on PYTHONPATH)"
        ) from exc
    try:
        model.load_state_dict(payload["weights"])
    except RuntimeError as exc:
        raise UserError(
            f"{Path(run_dir) / MODEL_FILE}: its weights do not fit the model its config builds "
            f"({one_line(exc)[:200]})"
        ) from exc
    return model.to(device).eval(), payload
