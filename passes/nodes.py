"""Node predicates and the `node.meta` keys the passes read and write.

The keys inside `node.meta["custom"]` are written by the traced runtime and defined with it, in
runtime/meta.py. Passes read group facts from there and
never from node names.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..runtime.mesh_info import parallelism_name
from ..runtime.meta import GROUP_KEY

C10D = torch.ops._c10d_functional  # the functional collectives traced graphs hold
TANGENT_PREFIX = "tangents"  # how AOTAutograd names the incoming gradients of a backward: `tangents_<i>`

# Top-level `node.meta` keys the scheduling passes set (passes/bucketing.py, passes/reorder.py).
# On an FSDP collective once bucketed: the tuple of the groups whose data it carries. GROUP_KEY stays
# the traced runtime's annotation (a merged collective keeps its first group's), so a collective's
# groups are read with `bucket_groups`.
BUCKET_META = "fsdp_graph_bucket"
PASS_META = "fsdp_graph_pass"  # on a node a scheduling pass made or moved: that pass's name
# On each collective of a bucket that passes/bucketing.py cut into column ranges: (piece index, pieces).
PIECE_META = "fsdp_graph_piece"
# Set by passes/async_tp.py on each chunk of a decomposed all-reduce: (chunk index, number of chunks).
ASYNC_TP_META = "fsdp_graph_async_tp"
# Set by passes/unshard_selection.py on a kept group's forward all-gather: its unsharded bytes.
KEPT_UNSHARDED_META = "fsdp_graph_kept_unsharded"
# Set by passes/reshard.py (`read_saved_inputs_outside`) on each `getitem` of a compile region's call
# in a joint graph; the partitioner copies it onto the backward's input where the forward saves it.
# Such a tensor is one of its own, whatever its fake value's storage says ([Note: Region outputs'
# fake storages] in passes/simulator.py).
REGION_OUTPUT_META = "fsdp_graph_region_output"
# In `node.meta["custom"]` of every node a slice of `fsdp_graph.api.run_in_chunks` made (forward
# and backward): the slice's index. Written by that wrapper through `torch.fx.traceback.annotate`.
CHUNK_KEY = "fsdp_graph_chunk"


def is_all_gather(node: Node) -> bool:
    """An all-gather: functional, or the `_out` form the gloo rewrite leaves (passes/gloo.py)."""
    return node.op == "call_function" and node.target in (
        C10D.all_gather_into_tensor.default, C10D.all_gather_into_tensor_out.default
    )


def is_reduce_scatter(node: Node) -> bool:
    return node.op == "call_function" and node.target is C10D.reduce_scatter_tensor.default


def is_all_reduce(node: Node) -> bool:
    """An all-reduce: functional, or in place as a gloo reduce-scatter becomes (passes/gloo.py)."""
    return node.op == "call_function" and node.target in (C10D.all_reduce.default, C10D.all_reduce_.default)


def is_all_to_all(node: Node) -> bool:
    """An all-to-all: expert parallelism's token dispatch and combine."""
    return node.op == "call_function" and node.target is C10D.all_to_all_single.default


def mutates_an_input(node: Node) -> bool:
    """An op whose schema writes one of its inputs: nothing may be moved across it."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def owned_by(node: Node, user: Node) -> bool:
    """`node` is a fresh tensor (no view or alias of another) that only `user` reads."""
    if node.op != "call_function" or set(node.users) != {user}:
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return False
    return all(ret.alias_info is None for ret in target._schema.returns)


def is_wait_tensor(node: Node) -> bool:
    return node.op == "call_function" and node.target is C10D.wait_tensor.default


def is_tangent_name(name: str) -> bool:
    """The name of an input that is a gradient flowing into a backward (`TANGENT_PREFIX`), in a
    joint graph, in a partitioned backward, and in a `Program` made of one."""
    return name.startswith(TANGENT_PREFIX)


def is_tangent(node: Node) -> bool:
    """A placeholder of the gradients flowing into a backward (`is_tangent_name`)."""
    return node.op == "placeholder" and is_tangent_name(node.name)


def is_backward_graph(graph: "torch.fx.Graph") -> bool:
    """A partitioned backward graph (it takes tangents), as opposed to a forward."""
    return any(is_tangent(n) for n in graph.find_nodes(op="placeholder"))


def is_region_call(node: Node) -> bool:
    """A compile region's call (`torch.compiler.nested_compile_region`, traced as `invoke_subgraph`)."""
    return node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph


def region_body(node: Node) -> Optional[GraphModule]:
    """The body a compile region's call runs (a submodule of the node's graph), or None."""
    if not is_region_call(node):
        return None
    owner, body = node.graph.owning_module, node.args[0]
    if owner is None or not isinstance(body, Node) or body.op != "get_attr":
        return None
    return getattr(owner, body.target, None)


def inline_regions(gm: GraphModule) -> GraphModule:
    """`gm`, changed in place, with the bodies of its compile regions in place of their calls ([Note:
    Blocks as compile regions] in traced/regions.py). The backend inlines them once our passes have
    scheduled a step, so that what runs is plain ops, which a user's TorchDispatchMode sees as it
    sees any step, where the region call itself is an operator such modes refuse; and before it
    compiles a graph whose regions do not compile ([Note: Regions that do not compile] in
    fsdp_graph/compile/backend.py). The inspector's programs show the ops so inlined."""
    from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph

    if any(is_region_call(node) for node in gm.graph.nodes):
        inline_invoke_subgraph(gm)
        gm.recompile()
    return gm


def is_collective(node: Node) -> bool:
    return is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node) or is_all_to_all(node)


def is_fsdp_collective(node: Node) -> bool:
    """A collective the traced runtime made for a group (it carries GROUP_KEY), as opposed to one
    of tensor parallelism or the user's: the passes bucket and move only these, and keep every
    other collective and its wait where it is, in its order ([Note: Traced tensor-parallel
    parameters] in traced/unshard.py)."""
    return is_collective(node) and group_of(node) is not None


def parallelism_of(node: Node) -> str:
    """Whose collective `node` is: "fsdp" for the traced runtime's; for any other, the name of the
    DeviceMesh dim its process group spans ("tp"), or else the process group's name."""
    if group_of(node) is not None:
        return "fsdp"
    group = _process_group(node)
    return str(node.args[-1]) if group is None else parallelism_name(group)


def backend_of(node: Node) -> Optional[str]:
    """The name of the backend (e.g. "gloo", "nccl") that runs collective `node` on its tensor's
    device; None where its group is not a registered process group (e.g. a graph traced elsewhere)."""
    group = _process_group(node)
    if group is None:
        return None
    device = getattr(node.meta.get("val"), "device", None) or torch.device("cpu")
    try:
        return group._get_backend(device).name()
    except RuntimeError:  # the group has no backend for that device
        return None


def _process_group(node: Node) -> Optional[Any]:
    """The process group collective `node` runs on (every functional collective takes its group's
    name last), or None where the group is gone or the name is not a registered one."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(node.args[-1])
    except (RuntimeError, ValueError, TypeError):
        return None


def bucket_groups(node: Node) -> tuple[str, ...]:
    """The groups whose data an FSDP collective carries: its bucket's (`BUCKET_META`), else its own."""
    return node.meta.get(BUCKET_META) or ((group_of(node) or "?"),)


def collective_label(node: Node) -> str:
    """How the inspector names a collective: its FSDP groups ("layers.0+layers.1" for a merged
    bucket, "layers.0 piece 2/3" for a piece of a split one), or "[tp]" (`parallelism_of`) for one
    that is not FSDP's, "[tp] chunk 2/4" for a chunk that passes/async_tp.py made."""
    if group_of(node) is not None:
        piece = node.meta.get(PIECE_META)
        return "+".join(bucket_groups(node)) + (f" piece {piece[0] + 1}/{piece[1]}" if piece else "")
    chunk = node.meta.get(ASYNC_TP_META)
    return f"[{parallelism_of(node)}]" + (f" chunk {chunk[0] + 1}/{chunk[1]}" if chunk else "")


def collective_of(wait: Node) -> Optional[Node]:
    """The collective a `wait_tensor` waits on, or None."""
    if is_wait_tensor(wait) and isinstance(wait.args[0], Node) and is_collective(wait.args[0]):
        return wait.args[0]
    return None


def wait_of(collective: Node) -> Optional[Node]:
    """The `wait_tensor` of a collective (the first, if several), or None."""
    return next((u for u in collective.users if is_wait_tensor(u)), None)


def fsdp_meta(node: Node, key: str) -> Optional[Any]:
    """The value the traced runtime annotated `node` with under `key`, or None."""
    custom = node.meta.get("custom")
    return custom.get(key) if isinstance(custom, dict) else None


def chunk_of(node: Node) -> Optional[int]:
    """The index of the `run_in_chunks` slice that made `node`, or None."""
    return fsdp_meta(node, CHUNK_KEY)


def group_of(node: Node) -> Optional[str]:
    return fsdp_meta(node, GROUP_KEY)


# [Note: Plans from size hints]
# A graph compiled with dynamic shapes (automatic dynamic after a second sequence length, or
# `torch.compile(dynamic=True)`) has symbolic sizes: `s0` where the static graph had 12. Turning one
# into a Python int (`int(t.numel())`, `if size > cap`) asks the shape environment for a guard, and a
# guard `Eq(2*s0, 24)` specialises the graph back to that one size: the next length recompiles. So
# the passes plan with size hints instead (`optimization_hint`: the size this compile was traced at,
# adding no guard): bucketing, the reordering's costs and the memory model see one concrete
# instance of the graph, and what they decide (which collectives share a bucket, the order of
# nodes) is valid for every size, since it changes no shape. What the hint does not bound is
# memory at larger sizes: see [Note: One collective set per frame] in passes/unshard_selection.py.

# A symbolic size with no hint (data-dependent, an unbacked symbol) plans as this many elements.
_NO_HINT = 4096


def size_hint(value: Any) -> int:
    """`value` (an int or a SymInt) as a plain int without a guard: [Note: Plans from size hints]."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=_NO_HINT)
    return int(value)


def tensor_nbytes(val: Any) -> int:
    """Bytes of a tensor's elements by its size hints ([Note: Plans from size hints]); 0 for anything
    that is not a tensor."""
    if not isinstance(val, torch.Tensor):
        return 0
    return size_hint(val.numel()) * val.element_size()


def value_bytes(val: Any) -> int:
    """Bytes of the tensors in a node's value (one tensor, or a tuple or list of them; 0 for
    anything else), by their size hints."""
    return sum(tensor_nbytes(leaf) for leaf in torch.utils._pytree.tree_leaves(val))


def tensor_bytes(node: Node) -> int:
    """Bytes of `node`'s tensor value, by its size hints; 0 when it is not a tensor."""
    return tensor_nbytes(node.meta.get("val"))


def gathered_from(node: Node) -> Optional[Node]:
    """The all-gather `node` is a view or copy of, following single-input ops (slice, view, clone,
    transpose...) back through the wait; None if `node` is computed from anything else."""
    while node.op == "call_function":
        if is_wait_tensor(node) and is_all_gather(node.args[0]):
            return node.args[0]
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None
