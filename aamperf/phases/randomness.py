"""memory=budget's pass over inductor's joint graph (aamperf/phases/memory.py): randomness saved, never
recomputed. Its own module: inductor's modules cost a second to import, and only memory=budget needs them."""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy


class KeepRandomness(CustomGraphPass):
    """memory=budget's pass over inductor's joint graph: every op that draws randomness (inductor's seeds for
    dropout's masks; a random op left whole) is saved for backward, never recomputed. Under a budget below 1
    torch's partitioner may recompute them, and a recomputed seed draws a new mask: backward then takes the
    gradient of another dropout than forward's, silently (pytorch/pytorch#190758, open on torch 2.13;
    tests/phases/test_memory_budget.py fails without this pass). A recomputed inductor_random draws
    forward's mask again from the saved seed."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(
                node.target, "tags", ()
            ):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> bytes:  # inductor's caches key compiled graphs by it: this file's hash
        return get_hash_for_files((__file__,))


KEEP_RANDOMNESS = KeepRandomness()
