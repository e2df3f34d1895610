"""All-gathers on gloo through gloo's plain allgather ([Note: All-gathers on gloo]), and
reduce-scatters on gloo as an all-reduce of their own buffer ([Note: Reduce-scatters on gloo]).

Both are rows of the pass table (passes/table.py): the first runs last among the scheduling passes,
on every scheduled graph (switching it off puts torch 2.13's gloo at risk as soon as two all-gathers
are in flight); the second runs on the graphs Inductor compiles, after the program for the inspector
is written (it changes no value and no byte on the wire).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .nodes import C10D, _process_group, backend_of, is_wait_tensor, owned_by


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
# all-reduces the clone and, at the wait, copies this rank's row out of it. A traced reduce-scatter's
# input is the packed gradient bucket, made for it alone (or its cast or pre-division), so the graph
# can all-reduce that buffer in place and read this rank's row as a view: the same all-reduce on
# gloo's wire and the same sums bit for bit, without the clone of the whole bucket and the copy
# (docs/benchmarks.md has the step times and heaps of both). The divide after it
# reads the row and makes the shard-sized gradient, so the bucket dies there as before. Only
# where the input is a flat bucket, a fresh tensor nothing else reads (not a view, not a graph
# input); any other reduce-scatter (tensor parallel's of activations: a row of those is not flat)
# stays as it is. Applied for Inductor only (aot_eager runs the graph as traced, op
# for op like eager mode) and after the program is written for the inspector, which shows the
# reduce-scatter as scheduled. The memory model keeps planning gloo's copies of a reduce-scatter
# (passes/simulator.py), true of aot_eager: under Inductor the heap stays about a bucket below the
# plan (an in-place all-reduce holds one row while it runs, repro/gloo_collective_scratch.py).
# What goes on gloo's wire must stay gloo's reduce-scatter's, an all-reduce: a rank that runs a group
# on the eager hooks (a fallback taken on that rank only) reduce-scatters it through gloo, and the
# other ranks' graphs must meet it. An all-to-all of the bucket's rows and their sum sends half the
# bytes on 2 ranks (examples/repro/gloo_reduce_scatter_bytes.py, torch alone; docs/benchmarks.md has
# its times), but a graph of them hung against such a rank
# (tests/test_compile_rank_divergence.py, `test_graph_break_on_one_rank`), and the torchtitan
# benchmark's step did not get faster with them (docs/graph_trainer_runs.md, "Quiet again").


def reduce_scatters_in_place_on_gloo(gm: GraphModule) -> GraphModule:
    """Each reduce-scatter on gloo of a flat bucket it owns, rewritten as `all_reduce_` of that input
    and this rank's row of it after the wait; see [Note: Reduce-scatters on gloo]."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not C10D.reduce_scatter_tensor.default:
            continue
        bucket, reduce_op, world, group_name = node.args
        waits = list(node.users)
        full = bucket.meta["val"]
        if full.dim() != 1:  # not a flat bucket: tensor parallel's reduce-scatter of activations
            continue
        if backend_of(node) != "gloo" or not owned_by(bucket, node) or not all(is_wait_tensor(w) for w in waits):
            continue
        rank = _process_group(node).rank()
        with gm.graph.inserting_before(node):
            reduced = gm.graph.call_function(C10D.all_reduce_.default, (bucket, reduce_op, group_name))
        reduced.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        reduced.meta["val"] = full
        for wait in waits:
            old_uses = list(wait.users)
            wait.args = (reduced,)
            wait.meta["val"] = full
            with gm.graph.inserting_after(wait):
                rows = gm.graph.call_function(torch.ops.aten.view.default, (wait, [world, -1]))
                rows.meta["val"] = full.view(world, -1)
            with gm.graph.inserting_after(rows):
                row = gm.graph.call_function(torch.ops.aten.select.int, (rows, 0, rank))
                row.meta["val"] = full.view(world, -1)[rank]
            for use in old_uses:
                use.replace_input_with(wait, row)
        gm.graph.erase_node(node)
    return gm
