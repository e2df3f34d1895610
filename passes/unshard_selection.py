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

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import Graph, GraphModule

from ..runtime.meta import GROUP_KEY, RESHARD_KEY, ROLE_KEY, ROLE_UNSHARD
from .nodes import KEPT_UNSHARDED_META, fsdp_meta, is_all_gather, is_tangent, size_hint, tensor_bytes
from .reshard import depends_on_tangents, tag_reshard_after_forward
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


def plan_unsharded(gm: GraphModule, memory_budget_bytes: int) -> list[UnshardChoice]:
    """The decision for each group that reshards after forward, in the order considered."""
    backward = depends_on_tangents(gm)
    sizes: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node in backward or not is_all_gather(node):
            continue
        if fsdp_meta(node, ROLE_KEY) == ROLE_UNSHARD and fsdp_meta(node, RESHARD_KEY):
            sizes[fsdp_meta(node, GROUP_KEY)] = tensor_bytes(node)
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


def partitioned_peak(gm: GraphModule) -> int:
    """The predicted peak bytes of the joint graph `gm` with every group that reshards after forward
    resharded, as the min-cut partitioner splits it (see the module docstring). `gm` is not changed."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node metas are copied, so tagging the copy is safe
    preview = tag_reshard_after_forward(GraphModule(gm, graph))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    num_primals = sum(not is_tangent(n) for n in placeholders)
    (outputs,) = graph.output_node().args
    # A joint graph returns the forward's outputs, then one gradient per primal input.
    forward, backward = min_cut_rematerialization_partition(preview, None, num_fwd_outputs=len(outputs) - num_primals)
    # What the forward allocated and saved lives in backward until its last use there (the simulator's
    # `saved_inputs`); the parameters' shards (primals) are the job's, not the step's.
    return max(memory_profile(program_of(forward)).peak_bytes, memory_profile(program_of(backward)).peak_bytes)


# [Note: A memory budget at other sizes]
# The passes plan a graph with symbolic sizes at its size hints ([Note: Plans from size hints] in
# passes/nodes.py), and every other decision holds at any size. This one does not: a group kept
# gathered fits the budget beside the activations of the traced sizes, and longer sequences have
# larger activations. So when it keeps a group, the graph is guarded to sizes up to its hints
# (`s0 <= 64`): a step at a size no larger reuses the graph, within the budget as planned (smaller
# activations, the same kept bytes); a larger one recompiles and plans again at its own size. With
# lengths rising step by step that is a graph per new longest length; without a budget, or with a
# budget that keeps nothing, the graph holds for every size.


def _bound_sizes_by_their_hints(gm: GraphModule) -> None:
    """Guard every symbolic size of the graph's inputs to at most its hint (see the note above)."""
    bounded = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        sizes = [val] if isinstance(val, torch.SymInt) else list(val.shape) if isinstance(val, torch.Tensor) else []
        for size in sizes:
            if isinstance(size, torch.SymInt) and str(size) not in bounded:
                bounded.add(str(size))
                bool(size <= size_hint(size))  # evaluating a symbolic comparison adds it as a guard


def select_unsharded(gm: GraphModule, memory_budget_bytes: Optional[int]) -> GraphModule:
    """Keep unsharded until backward the groups `plan_unsharded` chooses.

    Assumes: a joint graph with the traced runtime's annotations, before `reshard_after_forward`.
    Guarantees: the forward unshard nodes of each kept group are annotated as not resharding (so
    `reshard_after_forward` leaves them out and the partitioner saves their outputs), and its
    forward all-gather carries `meta[KEPT_UNSHARDED_META]` = its unsharded bytes, for the inspector.
    No other node changes; with no budget, nothing does.
    """
    if memory_budget_bytes is None:
        return gm
    choices = plan_unsharded(gm, memory_budget_bytes)
    kept = {c.group: c.unsharded_bytes for c in choices if c.kept}
    for c in choices:
        logger.info("fsdp_graph::unshard_selection %s %s: costs %d bytes, saves a %d-byte all-gather; "
                    "predicted peak %d of budget %d", "keeps" if c.kept else "reshards", c.group,
                    c.unsharded_bytes, c.unsharded_bytes, c.peak_bytes, memory_budget_bytes)
    if not kept:
        return gm
    _bound_sizes_by_their_hints(gm)
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
