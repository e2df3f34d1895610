"""All-gathers on gloo through gloo's plain allgather: see [Note: All-gathers on gloo].

Runs on every scheduled forward and backward graph, after the scheduling passes (it is not one of
them and cannot be switched off: without it, a schedule may put torch 2.13's gloo at risk).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .nodes import backend_of

_C10D = torch.ops._c10d_functional

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
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _C10D.all_gather_into_tensor.default:
            continue
        if backend_of(node) != "gloo":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(
                torch.ops.aten.empty.memory_format, (list(val.shape),), {"dtype": val.dtype, "device": val.device}
            )
            out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            out.meta["val"] = val
            gathered = gm.graph.call_function(_C10D.all_gather_into_tensor_out.default, tuple(node.args), {"out": out})
            gathered.meta.update(node.meta)
        node.replace_all_uses_with(gathered)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
