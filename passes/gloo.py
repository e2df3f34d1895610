"""All-gathers on gloo through gloo's plain allgather ([Note: All-gathers on gloo]), and
reduce-scatters on gloo as an all-to-all of their rows and a sum ([Note: Reduce-scatters on gloo]).

Both are rows of the pass table (passes/table.py): the first runs last among the scheduling passes,
on every scheduled graph (switching it off puts torch 2.13's gloo at risk as soon as two all-gathers
are in flight); the second runs on the graphs Inductor compiles, after the program for the inspector
is written (on 2 ranks it changes no value; it halves the bytes on the wire).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .nodes import C10D, backend_of, is_wait_tensor


# [Note: All-gathers on gloo]
# The functional `all_gather_into_tensor` that traced graphs use calls
# `allgather_into_tensor_coalesced` on the process group, and torch 2.13's gloo corrupts the heap when
# two or more of those (`AsyncAllgatherCoalescedWork`) are in flight on one group, and now and then
# when one is in flight beside a reduce-scatter: "malloc(): unaligned tcache chunk detected",
# "malloc_consolidate(): unaligned fastbin chunk detected" or SIGSEGV.
# examples/repro/gloo_all_gathers_in_flight.py shows it with torch alone. The functional
# `all_gather_into_tensor_out` calls `_allgather_base` instead, gloo's plain allgather (what the eager
# runtime uses too), which ran clean in the same loop with three in flight and beside reduce-scatters.
# So on gloo every all-gather of a scheduled graph becomes `all_gather_into_tensor_out` into a new
# buffer: the same values, waited on by the same `wait_tensor`. Other backends keep the functional op.


def plain_all_gathers_on_gloo(gm: GraphModule) -> GraphModule:
    """Each functional all-gather that runs on gloo rewritten as `all_gather_into_tensor_out` into a
    fresh buffer of its output's shape; uses of the old node read the new one (the buffer)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not C10D.all_gather_into_tensor.default:
            continue
        if backend_of(node) != "gloo":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(
                torch.ops.aten.empty.memory_format, (_gathered_size(gm, node),), {"dtype": val.dtype, "device": val.device}
            )
            out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            out.meta["val"] = val
            gathered = gm.graph.call_function(C10D.all_gather_into_tensor_out.default, tuple(node.args), {"out": out})
            gathered.meta.update(node.meta)
        node.replace_all_uses_with(gathered)
        gm.graph.erase_node(node)
    return gm


def _gathered_size(gm: GraphModule, gather: Node) -> list:
    """The size of `gather`'s output as graph arguments: ints, and for a symbolic dim (an
    activation's sequence length under tensor parallel) nodes that read it from the input, since a
    graph cannot take a SymInt of its own as an argument."""
    inp, world = gather.args[0], gather.args[1]
    size = []
    for dim, n in enumerate(gather.meta["val"].shape):
        if not isinstance(n, torch.SymInt):
            size.append(int(n))
            continue
        read = gm.graph.call_function(torch.ops.aten.sym_size.int, (inp, dim))
        read.meta["val"] = inp.meta["val"].shape[dim]
        if dim == 0:
            read = gm.graph.call_function(operator.mul, (read, world))
            read.meta["val"] = n
        size.append(read)
    return size


# [Note: Reduce-scatters on gloo]
# Gloo has no reduce-scatter of its own: for `reduce_scatter_tensor` it clones the whole input,
# all-reduces the clone and, at the wait, copies this rank's row out of it. An all-reduce moves
# every byte of the bucket twice over the ring (each rank sends 2(W-1)/W of it: the whole bucket on
# 2 ranks), where a reduce-scatter needs (W-1)/W once: the row each other rank owns. So a traced
# reduce-scatter of a flat bucket on gloo becomes what a reduce-scatter is on the wire: an
# all-to-all of the bucket's W rows (`all_to_all_single`, gloo's pairwise sends), after which each
# rank holds every rank's copy of its own row, and their sum in rank order, rows 0 + 1 + ... : half
# the bytes on 2 ranks, and on 2 ranks the same sum as gloo's all-reduce bit for bit (one addition,
# which is commutative; with more ranks the order of the additions is ours, not the ring's). The
# sum is one small kernel that Inductor fuses with the divide after it. Gloo's all-to-all ran clean
# with several in flight and beside the plain all-gathers
# (`examples/repro/gloo_all_gathers_in_flight.py --op alternate_all_to_all`, torch alone). The graph
# reads no rank: every rank's graph is the same, so ranks with equal shards share compiled graphs
# ([Note: Rank-independent cache keys] in fsdp_graph/compile/cache_key.py). Only a flat bucket summed
# by "sum" (what traced reduce-scatters are; tensor parallel's of activations are not flat) is
# rewritten. Applied for Inductor only (aot_eager runs the graph as traced, op for op like eager
# mode) and after the program is written for the inspector, which shows the reduce-scatter as
# scheduled. The memory model keeps planning gloo's copies of a reduce-scatter (passes/simulator.py),
# true of aot_eager: the all-to-all's output is one such copy, so under Inductor the plan holds.
# docs/benchmarks.md has the step times (torch alone: examples/repro/gloo_reduce_scatter_bytes.py).


def reduce_scatters_as_all_to_all_on_gloo(gm: GraphModule) -> GraphModule:
    """Each reduce-scatter (sum) on gloo of a flat bucket, rewritten as an all-to-all of its rows
    and their sum in rank order; see [Note: Reduce-scatters on gloo]."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not C10D.reduce_scatter_tensor.default:
            continue
        bucket, reduce_op, world, group_name = node.args
        waits = list(node.users)
        full = bucket.meta["val"]
        if full.dim() != 1 or reduce_op != "sum":  # not a flat bucket: tensor parallel's reduce-scatter of activations
            continue
        if backend_of(node) != "gloo" or not all(is_wait_tensor(w) for w in waits):
            continue
        rows = [full.numel() // world] * world
        with gm.graph.inserting_before(node):
            sent = gm.graph.call_function(C10D.all_to_all_single.default, (bucket, rows, rows, group_name))
        sent.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        sent.meta["val"] = torch.empty_like(full)
        for wait in waits:
            old_uses = list(wait.users)
            wait.args = (sent,)
            wait.meta["val"] = sent.meta["val"]
            row = _sum_of_rows(gm, wait, world)
            for use in old_uses:
                use.replace_input_with(wait, row)
        gm.graph.erase_node(node)
    return gm


def _sum_of_rows(gm: GraphModule, received: Node, world: int) -> Node:
    """`received.view(world, -1)`'s rows added in rank order, after `received`."""
    full = received.meta["val"]
    with gm.graph.inserting_after(received):
        rows = gm.graph.call_function(torch.ops.aten.view.default, (received, [world, -1]))
    rows.meta["val"] = full.view(world, -1)
    total, last = None, rows
    for rank in range(world):
        with gm.graph.inserting_after(last):
            row = gm.graph.call_function(torch.ops.aten.select.int, (rows, 0, rank))
        row.meta["val"] = rows.meta["val"][rank]
        last = row
        if total is not None:
            with gm.graph.inserting_after(last):
                total = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, row))
            total.meta["val"] = torch.empty_like(row.meta["val"])
            last = total
        else:
            total = row
    return total
