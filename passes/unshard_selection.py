"""Selective unsharding: under a memory budget, keep some groups unsharded from forward to backward.

A group that reshards after forward gathers its parameters twice per step: in forward, and again
in backward (passes/reshard.py). Keeping its unsharded parameters alive until backward instead
removes the second all-gather and costs the group's unsharded bytes for that span. With an explicit
`memory_budget_bytes`, this joint-graph pass (run before `reshard_after_forward`) chooses the groups
to keep; for them the budget overrides `reshard_after_forward=True` (or an int). Without a budget
nothing changes.

Cost model. Keeping group g saves one all-gather of b_g bytes per step and costs b_g bytes of
memory, so bytes saved per byte of memory is 1 for every group; what differs is how exposed the
skipped re-gather is. The backward re-gathers groups in reverse forward order, and the first one
(the last block's) has no compute before it to hide under, the next ones progressively more. So
the candidates are taken last block first, back towards the first, and each is kept if the
predicted peak still fits:

    peak(K) = peak({}) + sum(b_g for g in K) + max(b_g for g not in K) - max(b_g for every g)

i.e. a kept group's bytes stay through the forward-to-backward span, while resharded groups come
back one at a time as they are re-gathered. When even peak({}) is over the budget the pass keeps
nothing: today's schedule, never an error.

peak({}) comes from a preview (`partitioned_peak`): a copy of the joint graph with every candidate
resharded, split by the min-cut partitioner as the backend will split it, then the larger of the
forward's peak and the backward's by liveness (passes/simulator.py), each saved activation live
until its last use in backward. The joint graph's own liveness would keep every forward value that
backward reads, where the partitioner recomputes the cheap ones (pointwise chains), and so predict
too high a peak; tests/test_unshard_selection.py holds the preview to the peak of the graphs the
backend runs.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Optional

from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import Graph, GraphModule

from ..runtime.meta import GROUP_KEY, RESHARD_KEY, ROLE_KEY, ROLE_UNSHARD
from .nodes import KEPT_UNSHARDED_META, fsdp_meta, is_all_gather, is_tangent, tensor_bytes
from .reshard import depends_on_tangents, outer_joint_for_partition, tag_reshard_after_forward
from .simulator import memory_profile, program_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnshardChoice:
    """One candidate group. Attributes: group; unsharded_bytes (the memory keeping it costs, and the
    all-gather bytes per step it saves); kept; peak_bytes (the predicted peak after this decision)."""

    group: str
    unsharded_bytes: int
    kept: bool
    peak_bytes: int


# The groups the frame's first backward gathers again (a frozenset of group names), set on the joint
# graph of a later graph of the same frame: see [Note: One collective set per frame].
FIRST_BACKWARD_GATHERS_META = "fsdp_graph_first_backward_gathers"


def _candidates(gm: GraphModule) -> dict[str, int]:
    """The groups that reshard after forward, in forward order, each with its unsharded bytes."""
    backward = depends_on_tangents(gm)
    sizes: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node in backward or not is_all_gather(node):
            continue
        if fsdp_meta(node, ROLE_KEY) == ROLE_UNSHARD and fsdp_meta(node, RESHARD_KEY):
            sizes[fsdp_meta(node, GROUP_KEY)] = tensor_bytes(node)
    return sizes


def plan_unsharded(gm: GraphModule, memory_budget_bytes: int) -> list[UnshardChoice]:
    """The decision for each group that reshards after forward, in the order considered."""
    sizes = _candidates(gm)
    if not sizes:
        return []
    none_kept = partitioned_peak(gm)

    def peak(kept: set[str]) -> int:
        resharded = [b for g, b in sizes.items() if g not in kept]
        return none_kept + sum(sizes[g] for g in kept) + max(resharded, default=0) - max(sizes.values())

    kept: set[str] = set()
    choices = []
    for group in reversed(sizes):  # last block first: see the module docstring
        fits = peak(kept | {group}) <= memory_budget_bytes
        if fits:
            kept.add(group)
        choices.append(UnshardChoice(group, sizes[group], fits, peak(kept)))
    return choices


# [Note: One preview for two passes]
# The preview partitions a copy of the whole joint graph, the costliest work of the joint passes.
# With activation_checkpointing="auto" the checkpoint pass previews the graph first; where the peak
# fits the budget it leaves the graph as it was, and this pass, the next one, would preview the same
# graph again. So the peak is kept on the graph module with a fingerprint of what the partitioner
# reads of its nodes (each node's inputs, target and the tags of the checkpoint policy and the traced
# runtime; a compile region's body, which the joint passes do not change, by its call's target), and
# a second preview of an unchanged graph returns it.
_PEAK_META = "fsdp_graph_partitioned_peak"


def _fingerprint(gm: GraphModule) -> str:
    """A digest of `gm`'s nodes as the preview reads them ([Note: One preview for two passes])."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        meta = node.meta
        digest.update(repr((node.name, node.op, str(node.target), [n.name for n in node.all_input_nodes],
                            meta.get("recompute"), meta.get("ac_graph_id"), meta.get("custom"))).encode())
    return digest.hexdigest()


def partitioned_peak(gm: GraphModule) -> int:
    """The predicted peak bytes of the joint graph `gm` with every group that reshards after forward
    resharded, as the min-cut partitioner splits it (see the module docstring). `gm` is not changed
    but for the peak it keeps in its `meta` ([Note: One preview for two passes])."""
    fingerprint = _fingerprint(gm)
    kept = gm.meta.get(_PEAK_META)
    if kept is not None and kept[0] == fingerprint:
        return kept[1]
    peak = _preview_peak(gm)
    gm.meta[_PEAK_META] = (fingerprint, peak)
    return peak


def _preview_peak(gm: GraphModule) -> int:
    """`partitioned_peak` computed: a copy of `gm` partitioned, and the liveness of its two halves."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node metas are copied, so tagging the copy is safe
    # As the backend's partitioner does (fsdp_graph/compile/partition.py), a compile region's saved
    # input is read where the outer graph has it, so its backward gathers it again, and a checkpointed
    # value a region reads is saved.
    preview = outer_joint_for_partition(tag_reshard_after_forward(GraphModule(gm, graph)))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    num_primals = sum(not is_tangent(n) for n in placeholders)
    (outputs,) = graph.output_node().args
    # A joint graph returns the forward's outputs, then one gradient per primal input.
    forward, backward = min_cut_rematerialization_partition(preview, None, num_fwd_outputs=len(outputs) - num_primals)
    # What the forward allocated and saved lives in backward until its last use there (the simulator's
    # `saved_inputs`); the parameters' shards (primals) are the job's, not the step's.
    return max(memory_profile(program_of(forward)).peak_bytes, memory_profile(program_of(backward)).peak_bytes)


# [Note: One collective set per frame]
# Which groups a graph keeps decides which all-gathers its backward issues, and every rank must issue
# the same ones. Ranks that compile a frame's first graph together (fsdp_graph/compile/agreement.py)
# plan on the same graph and keep the same groups; where their shapes differ, or a rank may run
# groups on the eager hooks, the pass does not run (the table's `differs_from_eager`), as the hooks
# gather every resharding group again. But a rank recompiles a frame alone, at its own new size,
# while the others run the first graph: planned again at that size (larger activations), it would
# keep fewer groups, gather the others again in backward where the others' backward does not, and
# the ranks would wait on each other for ever. So a later graph of a frame keeps exactly the groups
# the frame's first graph kept: the backend tells the pass which groups the first backward gathers
# (`FIRST_BACKWARD_GATHERS_META`). The budget is therefore planned at the sizes of the frame's first
# graph ([Note: Plans from size hints] in passes/nodes.py) and holds at those sizes and smaller ones;
# at larger sizes the kept groups stay kept, and the peak grows with the activations, as in eager
# mode with `reshard_after_forward=False`. To plan for the longest sequences, let the first step
# (or `torch._dynamo.mark_dynamic`'s first graph) see them.


def select_unsharded(gm: GraphModule, memory_budget_bytes: Optional[int]) -> GraphModule:
    """Keep unsharded until backward the groups `plan_unsharded` chooses, or in a later graph of a
    frame those its first graph kept ([Note: One collective set per frame]).

    Assumes: a joint graph with the traced runtime's annotations, before `reshard_after_forward`.
    Guarantees: the forward unshard nodes of each kept group are annotated as not resharding (so
    `reshard_after_forward` leaves them out and the partitioner saves their outputs), and its
    forward all-gather carries `meta[KEPT_UNSHARDED_META]` = its unsharded bytes, for the inspector.
    No other node changes; with no budget, nothing does.
    """
    if memory_budget_bytes is None:
        return gm
    first_gathers = gm.meta.get(FIRST_BACKWARD_GATHERS_META)
    if first_gathers is not None:  # [Note: One collective set per frame]
        candidates = _candidates(gm)
        if not candidates:  # a compile region's body: no group, nothing to say
            return gm
        kept = {g: b for g, b in candidates.items() if g not in first_gathers}
        logger.info("fsdp_graph::unshard_selection keeps %s, as the frame's first graph does", sorted(kept) or "nothing")
        if not kept:
            return gm
    else:
        choices = plan_unsharded(gm, memory_budget_bytes)
        kept = {c.group: c.unsharded_bytes for c in choices if c.kept}
        for c in choices:
            logger.info("fsdp_graph::unshard_selection %s %s: costs %d bytes, saves a %d-byte all-gather; "
                        "predicted peak %d of budget %d", "keeps" if c.kept else "reshards", c.group,
                        c.unsharded_bytes, c.unsharded_bytes, c.peak_bytes, memory_budget_bytes)
        if not kept:
            return gm
    backward = depends_on_tangents(gm)
    for node in gm.graph.nodes:
        if node in backward or fsdp_meta(node, ROLE_KEY) != ROLE_UNSHARD:
            continue
        group = fsdp_meta(node, GROUP_KEY)
        if group in kept:
            # Annotations may share one dict between nodes: replace it, never mutate it.
            node.meta["custom"] = {**node.meta["custom"], RESHARD_KEY: False}
            if is_all_gather(node):
                node.meta[KEPT_UNSHARDED_META] = kept[group]
    return gm
