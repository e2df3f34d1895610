"""Reshard after forward inside a graph: the backward gathers again instead of keeping full weights.

AOTAutograd's min-cut partitioner saves every `_c10d_functional` output for backward unless it is
tagged for recompute, so by default a compiled forward keeps each group's unsharded parameters
alive until backward: the `reshard_after_forward=False` behaviour. This pass tags the forward part
of every unshard region whose group reshards after forward (see passes/nodes.py for the
annotations) as `MUST_RECOMPUTE`, one activation-checkpoint region per group. The partitioner then
saves the shards (graph inputs, free to keep) and replays the region in the backward:

    forward:  AG(g) -> compute(g)                      (unsharded parameters die after compute(g))
    backward: AG(g) again -> grad compute(g) -> RS(g)
"""

from __future__ import annotations

import logging

from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.meta import GROUP_KEY, RESHARD_KEY, ROLE_KEY, ROLE_UNSHARD
from .nodes import fsdp_meta

logger = logging.getLogger(__name__)

# Activation-checkpoint region ids for our regions; user regions count up from 0 or 1.
_FIRST_REGION_ID = 10_000


def depends_on_tangents(gm: GraphModule) -> set[Node]:
    """Nodes of a joint graph computed from a `tangents_*` input: the backward part."""
    backward: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
        elif any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def tag_reshard_after_forward(gm: GraphModule) -> GraphModule:
    """Tag each resharding group's forward unshard region for recompute.

    Assumes: a joint forward-backward graph whose unshard nodes carry the traced runtime's
    annotations. Guarantees: every forward node annotated as an unshard of a group with
    `reshard_after_forward` (copy-in, all-gather, wait, copy-out) has `meta["recompute"] =
    MUST_RECOMPUTE` and one `meta["ac_graph_id"]` per group, unless a user checkpoint region
    already tagged it. Backward nodes and other groups are untouched.
    """
    backward = depends_on_tangents(gm)
    region_ids: dict[str, int] = {}
    num_tagged = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        if fsdp_meta(node, ROLE_KEY) != ROLE_UNSHARD or not fsdp_meta(node, RESHARD_KEY):
            continue
        if "recompute" in node.meta:
            continue
        group = fsdp_meta(node, GROUP_KEY)
        region_ids.setdefault(group, _FIRST_REGION_ID + len(region_ids))
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = region_ids[group]
        num_tagged += 1
    if not num_tagged:
        return gm
    logger.debug("fsdp_graph::reshard_after_forward tagged %d nodes in %d groups", num_tagged, len(region_ids))
    gm.graph.lint()
    gm.recompile()
    return gm
