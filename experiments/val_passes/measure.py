"""The validation passes study's table (run.sh): for each run, its model's target R^2 on its validation
samples as one validation pass reads them (pass k: draw k of their ASVs under data.asv_sampling=random, the
bases the loss hides at step k), over DRAWS draws, and as the mean of 4 passes (trainer.val_passes=4) over
disjoint groups of them: how much one validation's figure moves with its draw, and how much less the mean's
does. The model in fp32, eager, on every whole validation batch (`validate` reads trainer.val_batches).
  python experiments/val_passes/measure.py [--draws 16] RUN_DIR...
"""

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from sklearn.metrics import r2_score

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.metrics.host import cpu_description
from aamperf.weights import load_model

CPU = torch.device("cpu")
GROUP = 4  # the passes a mean takes (trainer.val_passes=4)


@torch.no_grad()
def draws_of(run: Path, draws: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(each draw's predictions [draws, n] in the target's own units, the observed values [n], the run's seed)
    of the run's validation samples, in the val loader's order."""
    summary = json.loads((run / "summary.json").read_text())
    cfg = OmegaConf.create(summary["config"])
    loader = OmegaConf.merge(cfg.dataloader, {"num_workers": 0, "pin_memory": False})
    data = build_data(cfg.data, batch_size=summary["val_batch_size"], seed=cfg.seed, loader=loader)
    val_ids = [data.sample_ids[i] for i in data.val_loader.dataset.indices]
    assert val_ids == (run / "val_samples.txt").read_text().split(), f"{run}: another split than the run's"
    model, _ = load_model(run)
    model.eval()
    loss_fn = instantiate(cfg.loss)
    loss_fn.set_target(data.target)
    each, observed = [], None
    for draw in range(draws):
        data.val_loader.sampler.draw = draw
        values, seen = [], []
        for batch in data.val_loader:
            batch = to_device(batch, CPU)
            out = loss_fn.outputs(model, batch, draw)[0]
            values.append(loss_fn.target.inverse(out["target"][:, 0]))
            seen.append(batch["target"][:, 0])
        each.append(torch.cat(values).double().numpy())
        observed = torch.cat(seen).double().numpy()
    return np.stack(each), observed, cfg.seed


def spread(values: list[float]) -> str:
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return f"{mean:.3f} +- {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=16)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    rows, ratios = [], []
    for run in args.runs:
        each, observed, seed = draws_of(run, args.draws)
        single = [r2_score(observed, p) for p in each]
        means = [r2_score(observed, each[k : k + GROUP].mean(0)) for k in range(0, args.draws, GROUP)]
        ratios.append(statistics.stdev(single) / statistics.stdev(means))
        every = r2_score(observed, each.mean(0))
        cells = [
            str(seed),
            str(len(observed)),
            f"{single[0]:.3f}",
            spread(single),
            spread(means),
            f"{every:.3f}",
        ]
        rows.append(f"| {' | '.join(cells)} |")
    print(f"CPU: {cpu_description()}, torch {torch.__version__}; {args.draws} draws, means of {GROUP}\n")
    print(
        "| seed | validation samples | R^2, draw 0 (one pass) | R^2 of one pass: mean +- sd [min, max] over "
        f"{args.draws} draws | R^2 of the mean of {GROUP} passes: over {args.draws // GROUP} disjoint "
        f"groups | R^2 of the mean of all {args.draws} |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nsd of one pass's R^2 / sd of the mean of {GROUP}'s: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
