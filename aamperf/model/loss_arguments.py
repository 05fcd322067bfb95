"""AAMLoss's arguments checked, each problem one line naming its override (`loss.<name>=...`): by AAMLoss
as it is built, and by aamperf/checks.py before a run builds anything."""

import math
from collections.abc import Mapping
from typing import Any

from aamperf.model.masking import MASK_STRATEGIES

WEIGHTS = ("unifrac_weight", "nucleotide_weight", "target_weight", "count_weight")
# a regression's; a classification's is cross-entropy
TARGET_LOSSES = ("mse", "huber", "mae", "quantile", "asymmetric")


def argument_problems(args: dict[str, Any], prefix: str = "") -> list[str]:
    """Every problem of AAMLoss's arguments `args` (each one given or its default), as `<prefix><name>=
    <value> must ...`: checked by AAMLoss as it is built, and by aamperf/checks.py before a run builds
    anything. A negative weight would reward the error it weighs; a fraction of 0 hides no base (the
    nucleotide part has nothing to predict), of 1 or more every one."""
    problems = [
        f"{prefix}{name}={args[name]} must be a number >= 0"
        for name in WEIGHTS
        if not is_number(args[name]) or args[name] < 0
    ]
    problems += target_argument_problems(args, prefix)
    fraction = args["mask_fraction"]
    if not is_number(fraction) or not 0 < fraction < 1:
        problems.append(
            f"{prefix}mask_fraction={fraction} must be a number between 0 and 1 (the share of real bases "
            "hidden and predicted)"
        )
    if args["mask_strategy"] not in MASK_STRATEGIES:
        problems.append(
            f"{prefix}mask_strategy={args['mask_strategy']} must be one of {', '.join(MASK_STRATEGIES)}"
        )
    return problems


def target_argument_problems(args: dict[str, Any], prefix: str) -> list[str]:
    """The target part's: a known regression loss, quantiles strictly between 0 and 1, class weights
    `balanced` or a list of numbers >= 0 (their count is checked against the classes once they are read)."""
    problems = []
    if args["target_loss"] not in TARGET_LOSSES:
        problems.append(
            f"{prefix}target_loss={args['target_loss']} must be one of {', '.join(TARGET_LOSSES)}"
        )
    quantiles = list(args["quantiles"] or [])
    if not quantiles or not all(is_number(q) and 0 < q < 1 for q in quantiles):
        problems.append(f"{prefix}quantiles={quantiles} must be a list of numbers between 0 and 1")
    weights = args["class_weights"]
    if weights is not None and weights != "balanced":
        if isinstance(weights, str) or not all(is_number(w) and w >= 0 for w in weights):
            problems.append(
                f"{prefix}class_weights={weights} must be null, balanced or a list of numbers >= 0"
            )
    problems += category_weight_problems(args.get("category_weights"), prefix)
    if not is_number(args["huber_delta"]) or args["huber_delta"] <= 0:
        problems.append(f"{prefix}huber_delta={args['huber_delta']} must be a number > 0")
    for name in ("over_weight", "under_weight"):
        if not is_number(args[name]) or args[name] < 0:
            problems.append(
                f"{prefix}{name}={args[name]} must be a number >= 0 (asymmetric: the error's weight)"
            )
    return problems


def category_weight_problems(weights: Any, prefix: str) -> list[str]:
    """loss.category_weights: null, balanced, or category -> a finite number >= 0 (its keys are checked
    against the training samples' categories once they are read)."""
    if weights is None or weights == "balanced":
        return []
    numbers = isinstance(weights, Mapping) and all(
        isinstance(k, str) and is_number(w) and math.isfinite(w) and w >= 0 for k, w in weights.items()
    )
    if numbers and len(weights):
        return []
    return [
        f"{prefix}category_weights={weights} must be null, balanced or a mapping of data.weight_by's "
        "categories to numbers >= 0 (loss.category_weights={A:2.0,B:0.5})"
    ]


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
