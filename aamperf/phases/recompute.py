"""What torch.compile's partitioner may recompute for backward: aamperf's pass over inductor's joint graph
(forward and backward in one graph, before the partitioner splits it), set by the memory phase wherever a
compiled graph recomputes (aamperf/phases/memory.py). Its own module, imported where used: inductor's
modules cost a second or two to import on 2 cores (a run imports its config anyway: the system phase's
torch.use_deterministic_algorithms does)."""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy


class RecomputeRules(CustomGraphPass):
    """Two rules over the joint graph's nodes:

    - a graph input is never recomputed: torch 2.11 tags the symbolic sizes a checkpointed region takes as
      inputs (dynamic shapes) with the region's recompute policy, and its partitioner then neither saves
      them for backward nor can compute them there ("Node add_321 was invalid, but is output": every
      compile of a checkpointed block with dynamic shapes failed, and the run fell back to eager; seen on
      an H200, reproduced on a CPU; torch 2.13 tags no input). An input's value is at hand in forward,
      so the tag is dropped: the partitioner saves it as any input backward needs.
    - with `keep_randomness` (memory=budget): every op that draws randomness (inductor's seeds for
      dropout's masks; a random op left whole) is saved for backward, never recomputed. Under a budget
      below 1 torch's partitioner may recompute them, and a recomputed seed draws a new mask: backward
      then takes the gradient of another dropout than forward's, silently (pytorch/pytorch#190758, open on
      torch 2.13; tests/phases/test_memory_budget.py fails without this rule). A recomputed
      inductor_random draws forward's mask again from the saved seed.
    """

    def __init__(self, keep_randomness: bool):
        super().__init__()
        self.keep_randomness = keep_randomness

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "placeholder":
                node.meta.pop("recompute", None)
            elif (
                self.keep_randomness
                and node.op == "call_function"
                and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
            ):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> bytes:  # inductor's caches key compiled graphs by it: this file and the rules
        return get_hash_for_files((__file__,), extra=f"keep_randomness={self.keep_randomness}")


INPUTS_SAVED = RecomputeRules(keep_randomness=False)  # checkpoint wrappers' recompute (memory=full, ops, ...)
RANDOMNESS_KEPT = RecomputeRules(keep_randomness=True)  # memory=budget's
