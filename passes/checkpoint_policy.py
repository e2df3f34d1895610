"""Activation checkpointing chosen on the graph: each block saves what is costly to compute again
and recomputes the rest in backward.

The user's own checkpointing (`torch.utils.checkpoint` in the model) decides per module, before
tracing. With `activation_checkpointing="save_matmuls"` the backend decides on the joint graph
instead, as torchtitan's graph_trainer does by default: in every `fully_shard` group's forward, the
outputs of matmuls and attention are saved, and everything else the backward needs (norms,
activations, rotary embeddings, elementwise products) is recomputed from them there. A block's
parameters are gathered again in backward as before (passes/reshard.py), so the memory a step holds
from forward to backward is each block's matmul and attention outputs, and its input.

The pass tags each forward node of a group's module with `meta["recompute"]` (`MUST_SAVE` for a
costly op, `PREFER_RECOMPUTE` otherwise) and one `meta["ac_graph_id"]` per group, which torch's
min-cut partitioner honours as it does a checkpoint region's: a value read by the next group's
region is saved (`cleanup_recompute_tags`), so no block recomputes another's work. Left alone:
nodes a user's checkpoint already tagged, the FSDP unshard regions, collectives and their waits,
and nodes of no group (the root's embedding and loss). Ops whose values may differ when run again
(random ones, `topk` that routes tokens) are saved, so the backward sees the forward's numbers:
the step computes what it computes without the pass, bit for bit.

With `activation_checkpointing="auto"` the memory budget chooses ([Note: Checkpointing to fit a
budget]).
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.meta import ROLE_KEY
from ..runtime.multi_mesh_group import split_mesh_suffix
from .nodes import fsdp_meta, group_of, is_collective, is_region_call, is_wait_tensor, region_body
from .reshard import depends_on_tangents
from .unshard_selection import partitioned_peak

logger = logging.getLogger(__name__)

POLICIES = ("save_matmuls", "auto")
# Our policy's region ids: below the unshard regions' (passes/reshard.py), above a user's.
_FIRST_POLICY_REGION_ID = 5_000
_POLICY_REGION_IDS = range(_FIRST_POLICY_REGION_ID, 9_999)  # from 9_999 on: passes/reshard.py's regions

aten = torch.ops.aten
_COSTLY = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default, aten._grouped_mm.default,
    aten.topk.default,  # a router's choice: run again, ties could route otherwise
}


def _saved(node: Node) -> bool:
    """Costly to compute again, or possibly otherwise the second time (a random op); for an item
    of a multi-output op's result (attention's output and its statistics), that op's choice."""
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        node = node.args[0]
    target = node.target
    return target in _COSTLY or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
    )


def _group_of_module(node: Node, groups: list[str]) -> Optional[str]:
    """The `fully_shard` group whose module (or a submodule of it) made `node`: the longest group
    name that its innermost module path lies under, or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        path = path.removeprefix("L['self']").removeprefix(".")
        for group in groups:
            if path == group or path.startswith(group + "."):
                return group
    return None


def _tag(node: Node, region_id: int) -> bool:
    """Tag `node` for the partitioner; whether it is saved."""
    keep = _saved(node)
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    node.meta["ac_graph_id"] = region_id
    return keep


def _taggable(node: Node, backward: set[Node]) -> bool:
    """A forward op no one has chosen for: not a user's checkpoint region's, an FSDP unshard's, a
    collective or its wait, nor a compile region's call (its body chooses, `checkpoint_region_body`)."""
    if node.op != "call_function" or node in backward or "recompute" in node.meta:
        return False
    if node.target is operator.getitem and isinstance(node.args[0], Node) and is_region_call(node.args[0]):
        return False
    return not (fsdp_meta(node, ROLE_KEY) is not None or is_collective(node) or is_wait_tensor(node)
                or is_region_call(node))


# [Note: Checkpointing to fit a budget]
# `activation_checkpointing="auto"` with `memory_budget_bytes` makes recomputing a choice the budget
# makes, beside keeping groups unsharded (passes/unshard_selection.py): the step keeps every
# activation while its predicted peak (every resharding group resharded, as the partitioner will
# split the graph: `partitioned_peak`) fits the budget, and applies "save_matmuls" to every group
# when it does not. Recomputing costs compute the step cannot hide, a gather again in backward costs
# communication it can, so recomputing comes first only where nothing else fits: this pass runs
# before selective unsharding, which then spends what the policy freed on groups kept unsharded.
# All groups or none: blocks compiled as one region share one body, partitioned on its own before
# the step's joint graph exists (fsdp_graph/compile/partition.py), so in a graph with compile
# regions the pass cannot tag the bodies; it raises `CheckpointToFit` and the backend compiles the
# graph again with "save_matmuls". The choice moves no collective (the policy tags no unshard and
# no collective), so ranks that choose differently (a rank recompiling alone at a longer length)
# still put the same collectives on the wire.


class CheckpointToFit(Exception):
    """Raised by the "auto" policy on a graph with compile regions whose predicted peak is over the
    budget: the backend compiles it again with "save_matmuls" ([Note: Checkpointing to fit a budget])."""

    def __init__(self, peak_bytes: int, memory_budget_bytes: int) -> None:
        super().__init__(f"predicted peak {peak_bytes} bytes > memory_budget_bytes={memory_budget_bytes}")
        self.peak_bytes = peak_bytes
        self.memory_budget_bytes = memory_budget_bytes


def checkpoint_to_fit(error: BaseException) -> Optional[CheckpointToFit]:
    """The `CheckpointToFit` in `error` or in what it was raised from (the compilers wrap it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CheckpointToFit):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def checkpoint_by_policy(gm: GraphModule, policy: Optional[str] = "save_matmuls",
                         memory_budget_bytes: Optional[int] = None) -> GraphModule:
    """See the module docstring: "save_matmuls" on a step's joint graph, one region per group, or,
    with "auto", where `memory_budget_bytes` needs it ([Note: Checkpointing to fit a budget])."""
    named = {group_of(n) for n in gm.graph.nodes if n.op == "call_function"} - {None}
    groups = sorted({split_mesh_suffix(name)[0] for name in named}, key=len, reverse=True)
    if not groups:  # a compile region's body: `checkpoint_region_body` chooses there
        return gm
    if policy == "auto":
        if memory_budget_bytes is None or not _over_budget(gm, memory_budget_bytes):
            return gm
    elif policy != "save_matmuls":
        return gm
    backward = depends_on_tangents(gm)
    region_ids: dict[str, int] = {}
    tagged = saved = 0
    for node in gm.graph.nodes:
        group = _group_of_module(node, groups) if _taggable(node, backward) else None
        if group is None:
            continue
        region_ids.setdefault(group, _FIRST_POLICY_REGION_ID + len(region_ids))
        saved += _tag(node, region_ids[group])
        tagged += 1
    logger.debug("fsdp_graph::checkpoint_by_policy %d nodes in %d groups, %d saved", tagged, len(region_ids), saved)
    return gm


def _over_budget(gm: GraphModule, memory_budget_bytes: int) -> bool:
    """Whether the joint graph's predicted peak with every activation kept is over the budget; raises
    `CheckpointToFit` if so where the graph has compile regions."""
    peak = partitioned_peak(gm)
    over = peak > memory_budget_bytes
    logger.info("fsdp_graph::checkpoint_by_policy auto: predicted peak %d bytes %s memory_budget_bytes=%d: %s",
                peak, ">" if over else "<=", memory_budget_bytes,
                "save_matmuls in every group" if over else "every activation kept")
    if over and any(is_region_call(n) for n in gm.graph.nodes):
        raise CheckpointToFit(peak, memory_budget_bytes)
    return over


def recomputed_by_policy(gm: GraphModule) -> int:
    """The ops of backward graph `gm` that the policy recomputes there (a compile region's body
    counted once per call of it, as the step runs it): copies of forward ops it tagged."""
    count = 0
    for node in gm.graph.nodes:
        if is_region_call(node):
            count += recomputed_by_policy(region_body(node))
        elif node.op == "call_function" and node.meta.get("ac_graph_id") in _POLICY_REGION_IDS:
            count += 1
    return count


def checkpoint_region_body(gm: GraphModule) -> GraphModule:
    """The policy in the joint graph of a compile region's body, a block compiled once for all
    alike ([Note: Blocks as compile regions] in traced/regions.py), which the partitioner splits on
    its own: every forward op of the block, one region."""
    backward = depends_on_tangents(gm)
    for node in gm.graph.nodes:
        if _taggable(node, backward):
            _tag(node, _FIRST_POLICY_REGION_ID)
    return gm
