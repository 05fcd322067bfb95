"""AAM's arguments checked, each problem one line naming its override (`model.<name>=...`): by AAM as it
is built, and by aamperf/checks.py before a run builds anything."""

from typing import Any

import torch

# how categorical embeddings join the sample embedding (`AAM.condition`)
FUSIONS = ("concat", "add", "gmu", "cross_attention")
# how an ASV's log(1 + count) joins its vector (`AAM.with_counts`; the original's --count-embedding-method):
# add (a Linear of it added), concat (that Linear's output beside the vector, then Linear(2D, D)), film (a
# Linear(1, 2D) of it giving a scale and a shift: vector x (1 + scale) + shift)
COUNT_METHODS = ("add", "concat", "film")
# what the target head reads (`AAM(target_head=...)`): "linear" the sample embedding; "transformer" the sample
# encoder's per-ASV states, through a transformer of its own and an attention pooling (the original's
# target_encoder + target_pooling, aam/models/sequence_predictor.py), then a Linear
TARGET_HEADS = ("linear", "transformer")
# a regression's output through a function that bounds it (`AAM(target_activation=...)`): sigmoid to (0, 1),
# relu / softplus / exp to >= 0 (the original AAM's --bounded-targets and --output-activation)
TARGET_ACTIVATIONS = {
    "none": None,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "softplus": torch.nn.functional.softplus,
    "exp": torch.exp,
}
# AAM's integer arguments and the least each may be (0 layers: a stack that passes its input through)
LEAST = {
    "embedding_dim": 1,
    "num_heads": 1,
    "asv_layers": 0,
    "sample_layers": 0,
    "encoder_layers": 0,
    "max_asvs": 1,
    "ffn_mult": 1,
    "vocab_size": 1,
    "seq_len": 1,
    "target_dim": 0,  # 0: no target head
    "target_layers": 0,  # the transformer target head's layers (0: attention pooling and a Linear alone)
}


def argument_problems(args: dict[str, Any], prefix: str = "") -> list[str]:
    """Every problem of AAM's arguments `args` (each one given or its default), as `<prefix><name>=<value>
    must ...`: checked by AAM as it is built, and by aamperf/checks.py before a run builds anything."""
    problems = [
        f"{prefix}{name}={args[name]} must be an integer >= {least}"
        for name, least in LEAST.items()
        if isinstance(args[name], bool) or not isinstance(args[name], int) or args[name] < least
    ]
    dim, heads = args["embedding_dim"], args["num_heads"]
    if not problems and dim % heads:
        problems.append(f"{prefix}embedding_dim={dim} is not divisible by {prefix}num_heads={heads}")
    if args["target_head"] not in TARGET_HEADS:
        problems.append(f"{prefix}target_head={args['target_head']} must be one of {', '.join(TARGET_HEADS)}")
    activation = args["target_activation"]
    if activation not in TARGET_ACTIVATIONS:
        problems.append(
            f"{prefix}target_activation={activation} must be one of {', '.join(TARGET_ACTIVATIONS)}"
        )
    if args["count_embedding_method"] not in COUNT_METHODS:
        problems.append(
            f"{prefix}count_embedding_method={args['count_embedding_method']} must be one of "
            + ", ".join(COUNT_METHODS)
        )
    if not isinstance(args["categorical_output_scaling"], bool):
        problems.append(
            f"{prefix}categorical_output_scaling={args['categorical_output_scaling']} must be true or false"
        )
    if not isinstance(args["count_head"], bool):
        problems.append(f"{prefix}count_head={args['count_head']} must be true or false")
    layers = args["count_layers"]
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        problems.append(f"{prefix}count_layers={layers} must be null (sample_layers) or an integer >= 0")
    if args["categorical_fusion"] not in FUSIONS:
        problems.append(
            f"{prefix}categorical_fusion={args['categorical_fusion']} must be one of {', '.join(FUSIONS)}"
        )
    width = args["categorical_dim"]
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        problems.append(f"{prefix}categorical_dim={width} must be null (embedding_dim) or an integer >= 1")
    elif width is not None and width != args["embedding_dim"] and args["categorical_fusion"] == "add":
        problems.append(
            f"{prefix}categorical_fusion=add sums each column's embedding into the sample embedding: "
            f"{prefix}categorical_dim={width} must be null or {prefix}embedding_dim ({args['embedding_dim']})"
        )
    sizes = args["categorical_sizes"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        problems.append(f"{prefix}categorical_sizes={list(sizes)} must be a list of integers >= 0")
    for name in ("dropout", "target_dropout"):
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            problems.append(f"{prefix}{name}={value} must be a number in [0, 1)")
    hidden = args["target_hidden_dims"]
    if (
        hidden is None
        or isinstance(hidden, str | int | float)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in hidden)
    ):
        problems.append(
            f"{prefix}target_hidden_dims={hidden} must be a list of integers >= 1 (the MLP's widths)"
        )
    elif args["target_dropout"] and not len(hidden):
        problems.append(
            f"{prefix}target_dropout={args['target_dropout']} is the dropout between the MLP's layers of "
            f"{prefix}target_hidden_dims, which is empty: give its widths or {prefix}target_dropout=0"
        )
    elif args["target_residual"] and not len(hidden):
        problems.append(
            f"{prefix}target_residual=true adds a Linear beside the MLP of {prefix}target_hidden_dims, "
            f"which is empty: give its widths ({prefix}target_hidden_dims=[64]) or "
            f"{prefix}target_residual=false"
        )
    return problems
