"""The partitioner the backend uses: torch's min-cut partitioner, then two repairs of its output.

[Note: RNG states saved next to device meshes]
A sharded parameter is a DTensor graph input, so AOTAutograd passes its `DeviceMesh` into the joint
graph as an opaque input, and the backward graph needs it (the gradient is a DTensor on that mesh):
the forward saves the mesh for backward. Activation checkpointing recomputes its region in
backward; when the region holds a random op (CPU attention counts as one: it can drop out), the
partitioner stashes the RNG state in forward and appends it to the saved values, just before the
saved SymInts. torch 2.13 expects saved values in the order

    tensors (version-checked), tensors (not version-checked), opaque objects, SymInts

so an RNG state appended after the meshes lands in the opaque slice and the first compiled step
fails with "expected all tensors_saved_with_vc_check to be Tensors". `put_rng_states_with_tensors`
moves those RNG states (forward outputs and the matching backward inputs) back among the
version-checked tensors. Nothing else changes: no op, no value, only the order of the hand-off.

[Note: Symbolic fills that unpickle]
A compile region's backward makes zeros for an output that got no gradient, `aten.full(size, 0)`,
and in a graph symbolic in a length `size` holds a SymInt input. AOTAutogradCache stores the
backward graph pickled, and unpickling re-traces its code with FX proxies: an op whose only graph
value sits in an int list, as `full`'s, refuses the proxy, so the entry never loads and every
relaunch compiles that graph again (torch alone: examples/repro/region_symbolic_cache.py). An op
that takes a traced tensor is traced through it (a `view` to a symbolic size unpickles). So
`fills_from_a_tensor` builds each such fill from a tensor input of the graph: the value as a 0-d
tensor plus the sum of an empty slice of that input (exactly zero, no element read), cast to the
fill's dtype, expanded to the size and copied. The same values, and Inductor lowers it as one fill.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.fx import GraphModule, Node

from ..passes.checkpoint_policy import checkpoint_region_body
from ..passes.reshard import outer_joint_for_partition, save_inputs_not_their_views

_RUN_AND_SAVE_RNG_STATE = torch._prims.rng_prims.run_and_save_rng_state


def partition(
    joint: GraphModule, joint_inputs: Sequence[Any], checkpoint_policy: Optional[str] = None, **kwargs: Any
) -> tuple[GraphModule, GraphModule]:
    """`min_cut_rematerialization_partition`, with `put_rng_states_with_tensors` applied. A compile
    region's body saves its inputs rather than views of them, and an outer graph reads such an
    input where the region hands it back ([Note: Blocks as compile regions] in traced/regions.py).
    `checkpoint_policy` (the backend's `activation_checkpointing`) reaches a region's body here:
    the joint passes that apply it to the step's graph do not run on bodies under Inductor."""
    num_fwd_outputs = kwargs["num_fwd_outputs"]
    if not joint_inputs:  # a compile region's body, which AOTAutograd partitions on its own first
        joint = save_inputs_not_their_views(joint)
        if checkpoint_policy == "save_matmuls":  # "auto" chooses on the step's graph: [Note: Checkpointing to fit a budget]
            joint = checkpoint_region_body(joint)
    else:
        joint = outer_joint_for_partition(joint)
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    put_rng_states_with_tensors(forward, backward, num_fwd_outputs)
    for graph in (forward, backward):
        fills_from_a_tensor(graph)
    return forward, backward


def forget_partitioned_regions() -> None:
    """Drop what AOTAutograd kept of this compile's region bodies (their partitioned forward and
    backward, and the graphs traced from them), so that compiling the graph again partitions them
    again: with another checkpoint policy ([Note: Checkpointing to fit a budget] in
    passes/checkpoint_policy.py). Dynamo's own entries (which body each block reuses) stay."""
    context = torch._guards.TracingContext.try_get()
    cache = context.hop_dispatch_set_cache.get_cache(torch.ops.higher_order.invoke_subgraph) if context else None
    if cache is not None:
        for kept in (cache.autograd_cache, cache.proxy_dispatch_cache, cache.lazy_bwd_cache):
            kept.clear()


class InductorPartitioner(CustomPartitionerFn):
    """`partition` as Inductor's `custom_partitioner_fn` (Inductor runs its joint passes first)."""

    def __init__(self, checkpoint_policy: Optional[str] = None) -> None:
        self.checkpoint_policy = checkpoint_policy

    def __call__(self, gm: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        return partition(gm, joint_inputs, self.checkpoint_policy, **kwargs)

    def uuid(self) -> Optional[str]:
        return f"fsdp_graph.partition.v2.{self.checkpoint_policy}"


def fills_from_a_tensor(gm: GraphModule) -> None:
    """[Note: Symbolic fills that unpickle]: each `aten.full` whose size holds a graph value, in
    `gm` and the graphs it calls, built from a tensor input instead."""
    aten = torch.ops.aten
    for module in gm.modules():
        if not isinstance(module, GraphModule):
            continue
        graph = module.graph
        source = next((n for n in graph.find_nodes(op="placeholder")
                       if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0), None)
        fills = [n for n in graph.find_nodes(op="call_function", target=aten.full.default)
                 if any(isinstance(d, Node) for d in n.args[0]) and not isinstance(n.args[1], Node)
                 and isinstance(n.meta.get("val"), torch.Tensor)]
        if source is None or not fills:
            continue
        def add(op, args, kwargs=None, val=None):
            new = graph.call_function(op, args, kwargs or {})
            new.meta["val"] = val
            return new

        for node in fills:
            size, value = node.args
            made = node.meta["val"]
            with graph.inserting_before(node):
                empty = add(aten.slice.Tensor, (source, 0, 0, 0), val=source.meta["val"][0:0])
                zero = add(aten.sum.default, (empty,), val=empty.meta["val"].sum())
                scalar = add(aten.full.default, ([], value), {"dtype": made.dtype, "device": made.device},
                             val=made.new_full((), value))
                total = add(aten.add.Tensor, (scalar, zero), val=scalar.meta["val"] + zero.meta["val"])
                cast = add(torch.ops.prims.convert_element_type.default, (total, made.dtype), val=total.meta["val"].to(made.dtype))
                expanded = add(aten.expand.default, (cast, size), val=cast.meta["val"].expand(made.shape))
                filled = add(aten.clone.default, (expanded,), {"memory_format": torch.contiguous_format}, val=made)
            filled.meta = dict(node.meta)
            node.replace_all_uses_with(filled)
            graph.erase_node(node)
        module.recompile()


def _is_rng_state(node: Any) -> bool:
    return (
        isinstance(node, Node)
        and node.target is operator.getitem
        and node.args[1] == 0
        and isinstance(node.args[0], Node)
        and node.args[0].target is _RUN_AND_SAVE_RNG_STATE
    )


def _is_plain_saved_tensor(node: Any) -> bool:
    """A saved value in the first (version-checked tensors) slice of the hand-off."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and not node.meta.get("saved_tensor_with_no_vc_check", False)


def put_rng_states_with_tensors(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int) -> None:
    """See [Note: RNG states saved next to device meshes]. A no-op when the order is already right."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    saved = outputs[num_fwd_outputs:]
    rng = [n for n in saved if _is_rng_state(n)]
    if not rng:
        return
    rest = [n for n in saved if not _is_rng_state(n)]
    num_plain = 0
    while num_plain < len(rest) and _is_plain_saved_tensor(rest[num_plain]):
        num_plain += 1
    reordered = rest[:num_plain] + rng + rest[num_plain:]
    if reordered == saved:
        return
    output.args = (tuple(outputs[:num_fwd_outputs] + reordered),)

    # Backward inputs: saved SymInts first, then the saved values in the forward's order, the RNG
    # states last before the tangents (they are named after them).
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    num_symints = sum(1 for n in saved if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)))
    rng_inputs = [p for p in placeholders if p.name.startswith("rng_state_output")]
    if len(rng_inputs) != len(rng):
        raise RuntimeError(
            f"fsdp_graph: the backward graph has {len(rng_inputs)} RNG-state inputs for {len(rng)} saved "
            f"RNG states; please report this with the graph dump (FSDP_GRAPH_DUMP=dir)"
        )
    anchor = placeholders[num_symints + num_plain]
    for p in rng_inputs:
        anchor.prepend(p)
    forward.recompile()
    backward.recompile()
