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
import operator

from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.meta import GROUP_KEY, RESHARD_KEY, ROLE_KEY, ROLE_UNSHARD
from .cost_model import is_view
from .nodes import REGION_OUTPUT_META, fsdp_meta, is_region_call, is_tangent, region_body

logger = logging.getLogger(__name__)

# Activation-checkpoint region ids for our regions; user regions count up from 0 or 1.
_FIRST_REGION_ID = 10_000
_VIEWS_REGION_ID = _FIRST_REGION_ID - 1  # a region body's views of its inputs (`save_inputs_not_their_views`)
_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def depends_on_tangents(gm: GraphModule) -> set[Node]:
    """Nodes of a joint graph computed from a tangent (`is_tangent`): the backward part."""
    backward: set[Node] = set()
    for node in gm.graph.nodes:
        if is_tangent(node):
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
    return gm


def save_inputs_not_their_views(gm: GraphModule) -> GraphModule:
    """In the joint graph of a compile region's body: recompute in backward every forward view of
    a region input instead of saving it, so the region saves the input itself.

    A block compiled as a region ([Note: Blocks as compile regions] in traced/regions.py) takes its
    unsharded parameters as inputs. Left alone, the partitioner may save a view of one (the
    transposed weight a matmul's backward needs) as a region output; outside the region that is an
    opaque value, so the outer graph could neither see nor re-gather it, and every block would
    keep its full weights from forward to backward. Saving the input instead hands the outer graph
    the gathered parameter, which `tag_reshard_after_forward` makes it gather again in backward.
    Views cost nothing to recompute and hold no memory of their own, so nothing else changes.
    """
    backward = depends_on_tangents(gm)
    of_input: set[Node] = {n for n in gm.graph.nodes if n.op == "placeholder" and n not in backward}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in backward or not is_view(node):
            continue
        if node.all_input_nodes and node.all_input_nodes[0] in of_input and "recompute" not in node.meta:
            of_input.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = _VIEWS_REGION_ID
    return gm


def read_saved_inputs_outside(gm: GraphModule) -> GraphModule:
    """In an outer joint graph: where a compile region's forward returns one of its inputs as is
    (a value it saves for its backward, see `save_inputs_not_their_views`), make the users read
    that input directly. The region's backward then takes the unsharded parameter that the outer
    graph gathered, which `tag_reshard_after_forward` can make the backward gather again; the
    region's output was the same tensor under another name. Values unchanged.

    Every other output is then a tensor of its own, and is marked so (`REGION_OUTPUT_META`) for the
    memory model."""
    for hop in gm.graph.nodes:
        body = region_body(hop)
        if body is None:
            continue
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        outputs = body.graph.find_nodes(op="output")[0].args[0]
        operands = hop.args[2:]
        for user in list(hop.users):
            if user.target is not operator.getitem:
                continue
            out = outputs[user.args[1]]
            if isinstance(out, Node) and out.op == "placeholder":
                user.replace_all_uses_with(operands[placeholders.index(out)])
            else:
                user.meta[REGION_OUTPUT_META] = True
    return gm


def outer_joint_for_partition(gm: GraphModule) -> GraphModule:
    """An outer joint graph (not a region's body) as the min-cut partitioner should see its compile
    regions: `read_saved_inputs_outside`, then `save_checkpointed_values_regions_read`."""
    return save_checkpointed_values_regions_read(read_saved_inputs_outside(gm))


def save_checkpointed_values_regions_read(gm: GraphModule) -> GraphModule:
    """In an outer joint graph: a value that the user's activation checkpointing marks for recompute
    and that a compile region reads is saved instead. Values unchanged.

    [Note: A checkpointed block before a region]
    Torch's partitioner saves a checkpointed block's output where the next checkpointed block reads
    it, so that a backward recomputes each block on its own, just before that block's gradient.
    A region is such a next block, but its call carries no checkpoint tag, so the rule does not see
    it. Where a checkpointed block traced inline precedes a region (the first block of a kind is
    traced inline: [Note: Every block a compile region] in traced/regions.py), the block's
    output was left to recompute, and the region's backward, which reads its input, needed it: the
    backward gathered the inline block's parameters and recomputed that block, attention included,
    before the region's gradient, and held it until the block's own gradient (torchtitan's layer 0
    before layer 1; the region's backward was then compiled as two pieces of its own). Saving the
    value is what eager checkpointing does: the next block's checkpoint keeps its input.
    """
    for node in gm.graph.nodes:
        if _recomputed_by_users_checkpoint(node) and any(is_region_call(user) for user in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


def _recomputed_by_users_checkpoint(node: Node) -> bool:
    """Whether the user's activation checkpointing, not one of our regions (resharding, a region's
    views of its inputs), tagged the node for recompute."""
    return node.meta.get("recompute") in _RECOMPUTED and node.meta.get("ac_graph_id", _VIEWS_REGION_ID) < _VIEWS_REGION_ID
