"""aamperf's rules over inductor's joint graph (aamperf/phases/recompute.py): graph inputs are never
recomputed, and under memory=budget randomness is kept; which rules a job sets."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from aamperf.model.layers import Transformer
from aamperf.phases.memory import UNBUDGETED, apply_checkpointing, set_compiled_recompute
from aamperf.phases.recompute import INPUTS_SAVED, RANDOMNESS_KEPT

PREFER = CheckpointPolicy.PREFER_RECOMPUTE


def joint_graph() -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
    """A checkpointed region's joint graph as torch 2.11 traces it with dynamic shapes: its symbolic size
    (an input) tagged with the region's policy, as every op of the region is."""
    graph = torch.fx.Graph()
    size, x = graph.placeholder("primals_1"), graph.placeholder("primals_2")
    size.meta["recompute"] = PREFER
    noise = graph.call_function(torch.ops.aten.rand.default, ([size],))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, noise))
    for node in (noise, y):
        node.meta["recompute"] = PREFER
    graph.output(y)
    return graph, {"size": size, "x": x, "noise": noise, "y": y}


@pytest.mark.parametrize("rules", [INPUTS_SAVED, RANDOMNESS_KEPT], ids=["inputs_saved", "randomness_kept"])
def test_no_graph_input_is_left_to_recompute(rules):
    graph, nodes = joint_graph()
    rules(graph)
    assert "recompute" not in nodes["size"].meta and "recompute" not in nodes["x"].meta
    assert nodes["y"].meta["recompute"] == PREFER  # the region's ops keep their policy


def test_randomness_is_saved_only_under_a_budget():
    graph, nodes = joint_graph()
    INPUTS_SAVED(graph)
    assert nodes["noise"].meta["recompute"] == PREFER
    RANDOMNESS_KEPT(graph)
    assert nodes["noise"].meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert INPUTS_SAVED.uuid() != RANDOMNESS_KEPT.uuid()  # inductor's caches tell the two apart


@pytest.mark.parametrize(
    "budget, rules", [(UNBUDGETED, INPUTS_SAVED), (0.5, RANDOMNESS_KEPT)], ids=["wrappers", "budget"]
)
def test_a_job_that_recomputes_sets_the_rules_and_the_next_job_drops_them(budget, rules):
    try:
        set_compiled_recompute(True, budget)
        assert torch._inductor.config.joint_custom_post_pass is rules
    finally:
        set_compiled_recompute(False, UNBUDGETED)
    assert torch._inductor.config.joint_custom_post_pass is None


@pytest.mark.parametrize("compiles, rules", [(True, INPUTS_SAVED), (False, None)])
def test_the_rules_are_set_only_where_the_model_may_be_compiled(make_cfg, compiles, rules):
    """An eager run (compile=disabled) leaves inductor's config as torch has it: no rules."""
    stack = Transformer(dim=16, num_heads=2, num_layers=2, ffn_mult=2, dropout=0.1)
    try:
        record = apply_checkpointing(stack, make_cfg("memory=full").memory, compiles=compiles)
        assert record["status"] == "applied" and record["layers"] == 2
        assert torch._inductor.config.joint_custom_post_pass is rules
    finally:
        set_compiled_recompute(False, UNBUDGETED)
