"""Stamp a captured block out to a deeper model: the joint graph of a model of many identical
blocks, made from the trace of a few.

[Note: Stamping blocks]
Tracing a step costs Dynamo's and AOTAutograd's time per block, and a prediction
(fsdp_graph/predict.py) only needs the graph, not the trace. A model whose blocks share their code,
shapes and sharding traces the same nodes for each block, so the trace of a few blocks holds
everything the trace of many would: `stamp_blocks` takes the joint
graph of a model traced with its first `k - 1` blocks and its last one, and copies block `k - 2`
(the template, a middle block) to stand for the blocks that were left out.

Each block's nodes are found by the module path AOTAutograd records on them (`nn_module_stack` in
forward, `fwd_nn_module_stack` in backward) and form two runs of the graph, one in the forward and
one in the backward; a node of no block inside a block's run (a gradient accumulation) belongs to
that run. A copy takes the template's nodes in order, with fresh inputs for the template's own
parameters, and reads what the template read, shifted by one block per copy: where the template
read its predecessor's node at position `j` of that block's run, copy `c` reads copy `c - 1`'s
node at position `j`; where it read its successor's backward (the gradient flowing in), it reads the
next copy's. The template's neighbours must therefore hold the same nodes in the same order as the
template; `stamp_blocks` checks that and raises `ValueError` where they do not. The copies' fake
tensors are new ones with the template's aliasing among them, so that the memory model counts each
block's storages once per block, and each copy carries its own block's group name and its own
activation checkpointing region.
tests/test_predict.py compares a stamped graph with the trace of the whole model: the same ops, and
the same prediction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map_only

from ..runtime.meta import GROUP_KEY
from ..runtime.multi_mesh_group import split_mesh_suffix
from .nodes import is_tangent

_FORWARD, _BACKWARD = "forward", "backward"


@dataclass
class _Block:
    """One traced block in the joint graph: its forward nodes and its backward nodes, each one run
    of the graph, and its inputs: one run of the graph's primal inputs, those it reads or makes the
    gradient of, with the unread ones among them (a parameter's mesh)."""

    runs: dict[str, list[Node]]
    inputs: list[Node] = field(default_factory=list)

    @property
    def nodes(self) -> list[Node]:
        """Its forward's nodes, then its backward's."""
        return [n for run in self.runs.values() for n in run]


@dataclass
class _DeepModel:
    """The deep model's blocks as the stamped graph holds them, each at its slot: traced blocks
    0..template at their own, the copies at template + 1..template + copies, and the traced blocks
    after the template `copies` further on.

    Attributes:
        blocks: the traced blocks, by their index in the trace.
        template: the traced block the copies are made of (a middle one, `k - 2`).
        copies: how many copies stand for the blocks the trace left out.
        where: a traced block's node or input -> (block, run kind or "inputs", index in it).
        made: a copy's slot -> its runs and inputs, filled as they are made.
    """

    blocks: dict[int, _Block]
    template: int
    copies: int
    where: dict[Node, tuple[int, str, int]]
    made: dict[int, dict[str, list[Node]]] = field(default_factory=dict)

    def node_at(self, slot: int, kind: str, j: int) -> Node:
        """The node at `j` of `kind`'s run of the deep model's block `slot`."""
        if slot in self.made:
            return self.made[slot][kind][j]
        block = self.blocks[slot if slot <= self.template else slot - self.copies]
        return block.inputs[j] if kind == "inputs" else block.runs[kind][j]

    def reads(self, slot: int, traced: int) -> Callable[[Node], Node]:
        """How a node of traced block `traced` reads, standing as block `slot` of the deep model:
        what it read of block `traced + d`, it reads of block `slot + d`."""
        def remap(arg: Node) -> Node:
            if arg not in self.where:
                return arg  # of no block: shared by all
            i, kind, j = self.where[arg]
            return self.node_at(slot + i - traced, kind, j)

        return remap

    def rewire_traced_blocks(self) -> None:
        """The traced blocks read their neighbours as they stand now: the last block reads the last copy."""
        for i, block in self.blocks.items():
            remap = self.reads(i if i <= self.template else i + self.copies, i)
            for run in block.runs.values():
                for node in run:
                    node.args, node.kwargs = torch.fx.map_arg((node.args, node.kwargs), remap)


def stamp_blocks(
    joint: GraphModule,
    blocks_path: str,
    group_names: list[str],
    num_fwd_outputs: int,
    static_input_indices: Optional[list[int]] = None,
) -> list[int]:
    """Stamp `joint` out in place ([Note: Stamping blocks]): its model ran the first `k - 1` of
    the blocks under `blocks_path` (e.g. "layers") and then the last; afterwards the graph holds
    all `len(group_names)` blocks, `group_names` being their FSDP groups' names in order. Returns
    AOTAutograd's `static_lifetime_input_indices` for the stamped graph's inputs."""
    graph = joint.graph
    primals = [n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    output = next(iter(graph.find_nodes(op="output")))
    grads = list(output.args[0])[num_fwd_outputs:]
    if len(grads) != len(primals):
        raise ValueError(f"the joint graph has {len(grads)} gradients for {len(primals)} primal inputs")
    blocks = _find_blocks(graph, blocks_path, primals, grads)
    deep = _plan_deep_model(graph, blocks, blocks_path, len(group_names), num_fwd_outputs)
    static = list(static_input_indices or [])
    if deep.copies == 0:
        return static
    if not blocks[deep.template].inputs:
        raise ValueError(f"block {blocks_path}.{deep.template} has no inputs of its own: a block to stamp must be a "
                         f"fully_shard group of its own")
    _copy_template(graph, deep, group_names)
    deep.rewire_traced_blocks()
    first, end = _add_copies_gradients(output, deep, primals, grads, num_fwd_outputs)
    graph.lint()
    joint.recompile()
    return _stamped_static_indices(static, first, end, deep.copies)


def _plan_deep_model(graph: Graph, blocks: dict[int, _Block], blocks_path: str, num_blocks: int,
                     num_fwd_outputs: int) -> _DeepModel:
    """Where the traced blocks and the copies of the template stand in a model of `num_blocks`
    blocks, after checking that the trace can be stamped out to it."""
    k = len(blocks)
    if k < 4:
        raise ValueError(f"stamping needs a trace of at least 4 blocks under {blocks_path!r} (the first, two "
                         f"middle ones and the last), found {k}")
    if num_blocks < k:
        raise ValueError(f"stamping makes a model deeper: {num_blocks} group names for {k} traced blocks")
    where = {}  # a traced block's node or input -> (block, run kind or "inputs", index in it)
    for i, block in blocks.items():
        for kind, run in (*block.runs.items(), ("inputs", block.inputs)):
            for j, node in enumerate(run):
                where[node] = (i, kind, j)
    template = k - 2
    _check_alike(blocks, template, blocks_path, where)
    _check_no_outside_reads(graph, blocks[template], where, num_fwd_outputs)
    return _DeepModel(blocks, template, num_blocks - k, where)


def _copy_template(graph: Graph, deep: _DeepModel, group_names: list[str]) -> None:
    """Make the copies of the template: their inputs, then their forward and backward runs, each
    reading its neighbours among the deep model's blocks."""
    template, copies = deep.template, deep.copies
    mine = deep.blocks[template]
    regions = _make_room_for_regions(graph, mine, copies)
    shared = _shared_storages(graph, mine)
    storages = {c: dict.fromkeys(shared) for c in range(1, copies + 1)}  # the template's storage -> copy c's
    made = deep.made
    for c in range(1, copies + 1):
        made[template + c] = {"inputs": _copy_inputs(graph, mine.inputs, made.get(template + c - 1, {}).get("inputs"),
                                                     c, storages[c]),
                              _FORWARD: [], _BACKWARD: []}
    # The forward copies go after the template's run, each after the one before; the backward
    # runs the blocks in reverse, so the deepest copy's backward comes first, before the template's.
    anchor = mine.runs[_FORWARD][-1]
    for c in range(1, copies + 1):
        anchor = _copy_run(graph, mine.runs[_FORWARD], made[template + c][_FORWARD], anchor, True,
                           deep.reads(template + c, template), storages[c], group_names[template + c], regions * c)
    for c in range(copies, 0, -1):
        _copy_run(graph, mine.runs[_BACKWARD], made[template + c][_BACKWARD], mine.runs[_BACKWARD][0], False,
                  deep.reads(template + c, template), storages[c], group_names[template + c], regions * c)


def _add_copies_gradients(output: Node, deep: _DeepModel, primals: list[Node], grads: list,
                          num_fwd_outputs: int) -> tuple[int, int]:
    """The outputs: the forward's, then a gradient per primal input; the copies' inputs come after
    the template's, so their gradients do too, read as the template's are. Returns where the
    template's inputs are among the primal inputs, `first:end`."""
    template, copies = deep.template, deep.copies
    mine = deep.blocks[template]
    index = {p: i for i, p in enumerate(primals)}
    first, end = index[mine.inputs[0]], index[mine.inputs[-1]] + 1
    added = [torch.fx.map_arg(grads[index[p]], deep.reads(template + c, template)) for c in range(1, copies + 1)
             for p in mine.inputs]
    output.args = (tuple(_stamped_outputs(list(output.args[0]), num_fwd_outputs, first, end, added)),)
    if "desc" in output.meta:  # AOTAutograd's description of each output, which its partitioner zips with them
        descs = list(output.meta["desc"])
        output.meta["desc"] = _stamped_outputs(descs, num_fwd_outputs, first, end,
                                               descs[num_fwd_outputs + first:num_fwd_outputs + end] * copies)
    return first, end


def _stamped_static_indices(static: list[int], first: int, end: int, copies: int) -> list[int]:
    """AOTAutograd's static input indices `static` of the traced graph, after each copy's inputs
    went in after the template's (`first:end`): later inputs move up, and a copy's input is static
    where the template's is."""
    width = end - first
    return sorted([i if i < end else i + copies * width for i in static]
                  + [end + (c - 1) * width + (i - first) for c in range(1, copies + 1) for i in range(first, end)
                     if i in static])


def _make_room_for_regions(graph: Graph, template: _Block, copies: int) -> int:
    """Activation checkpointing regions are numbered in the order they run (`ac_graph_id`), which
    the partitioner compares to save a tensor between two adjacent regions. Returns a step by which
    each copy's regions follow the one before's; the regions after the template's move up by as
    many steps as there are copies."""
    ids = [n.meta["ac_graph_id"] for n in graph.nodes if "ac_graph_id" in n.meta]
    mine = [n.meta["ac_graph_id"] for run in template.runs.values() for n in run if "ac_graph_id" in n.meta]
    if not mine:
        return 0
    step, last = max(ids) - min(ids) + 1, max(mine)
    for node in graph.nodes:
        if node.meta.get("ac_graph_id", last) > last:
            node.meta["ac_graph_id"] += copies * step
    return step


def _stamped_outputs(outputs: list, num_fwd_outputs: int, first: int, end: int, added: list) -> list:
    """The joint graph's outputs (or their descriptions) with the copies' gradients `added` after
    the template's, whose inputs are `first:end` of the primal inputs."""
    cut = num_fwd_outputs + end
    return outputs[:cut] + added + outputs[cut:]


def _block_reader(blocks_path: str) -> Callable[[Node], Optional[int]]:
    pattern = re.compile(r"^L\['self'\]\." + re.escape(blocks_path) + r"\.(\d+)(?:\.|$)")

    def block_of(node: Node) -> Optional[int]:
        """The block whose module the node was traced in (forward) or for (backward), or None."""
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        for path, _ in stack.values():
            match = pattern.match(path)
            if match:
                return int(match.group(1))
        return None

    return block_of


def _find_blocks(graph: Graph, blocks_path: str, primals: list[Node], grads: list) -> dict[int, _Block]:
    block_of = _block_reader(blocks_path)
    nodes = list(graph.nodes)
    backward_from = next((i for i, n in enumerate(nodes) if any(is_tangent(a) for a in n.all_input_nodes)), len(nodes))
    spans: dict[tuple[int, str], list[int]] = {}
    for index, node in enumerate(nodes):
        block = block_of(node) if node.op == "call_function" else None
        if block is not None:
            kind = _FORWARD if index < backward_from else _BACKWARD
            spans.setdefault((block, kind), [index, index])[1] = index
    found: dict[int, _Block] = {}
    for (block, kind), (first, last) in spans.items():
        run = nodes[first:last + 1]
        others = {b for n in run if (b := block_of(n)) is not None and b != block}
        if others or any(n.op != "call_function" for n in run):
            raise ValueError(f"block {blocks_path}.{block}'s {kind} nodes are interleaved with other blocks' "
                             f"({sorted(others)}): the blocks cannot be stamped; capture the whole model")
        found.setdefault(block, _Block({})).runs[kind] = run
    if sorted(found) != list(range(len(found))) or any(len(b.runs) != 2 for b in found.values()):
        raise ValueError(f"the blocks under {blocks_path!r} do not each have a forward and a backward in the trace")

    # A primal input is a block's if only that block reads it, or if that block makes its gradient;
    # a block's inputs run from its first to its last.
    owner = {n: i for i, b in found.items() for n in b.nodes}
    for i, block in found.items():
        owned = [j for j, p in enumerate(primals)
                 if ({owner.get(u) for u in p.users if u.op != "output"} == {i})
                 or (isinstance(grads[j], Node) and owner.get(grads[j]) == i)]
        if owned:
            block.inputs = primals[owned[0]:owned[-1] + 1]
    return found


def _check_alike(blocks: dict[int, _Block], template: int, blocks_path: str, own: dict[Node, Any]) -> None:
    """The template's neighbours must trace what it traces, node for node: the same ops on tensors
    of the same shapes, and inputs of the same shapes. The one before it, a middle block too, must
    also read the same nodes of no block: a block that reads its own mask, made outside it (every
    other layer's sliding window), is one the copies cannot stand for. `own`: the traced blocks'
    nodes and inputs."""

    def shape(block: _Block, outside_reads: bool) -> list:
        return ([(n.target, _signature(n.meta.get("val")),
                  [a for a in n.all_input_nodes if a not in own] if outside_reads else None) for n in block.nodes]
                + [_signature(p.meta.get("val")) for p in block.inputs])

    for neighbour in (template - 1, template + 1):
        outside_reads = neighbour < template  # the last block reads the gradient flowing in from outside
        if shape(blocks[neighbour], outside_reads) != shape(blocks[template], outside_reads):
            raise ValueError(f"blocks {blocks_path}.{neighbour} and {blocks_path}.{template} trace different nodes or "
                             f"inputs: they cannot stand for one another; capture the whole model")


def _signature(val: Any) -> Any:
    """The shapes and dtypes of a node's value."""
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(_signature(v) for v in val)
    return type(val).__name__


def _check_no_outside_reads(graph: Graph, template: _Block, inside: dict[Node, Any], num_fwd_outputs: int) -> None:
    """Only blocks (`inside`: their nodes and inputs) and the graph's gradient outputs may read the
    template's nodes: anything else (a list of every block's output) would read the traced blocks
    only, where the deep model's would read all of them."""
    mine = set(template.nodes)
    for node in graph.nodes:
        if node.op == "output":
            forward_outputs: list[Node] = []
            torch.fx.map_arg(list(node.args[0])[:num_fwd_outputs], forward_outputs.append)
            read = [a for a in forward_outputs if a in mine]
        elif node not in inside:
            read = [a for a in node.all_input_nodes if a in mine]
        else:
            continue
        if read:
            raise ValueError(f"{node.name} reads {[a.name for a in read]} of one block from outside its block: the "
                             f"blocks cannot be stamped; capture the whole model")


def _copy_run(graph: Graph, run: list[Node], into: list[Node], anchor: Node, after: bool,
              remap: Callable[[Node], Node], storages: dict, group_name: str, region_offset: int) -> Node:
    for node in run:
        with graph.inserting_after(anchor) if after else graph.inserting_before(anchor):
            new = graph.node_copy(node, remap)
        _own_meta(node, new, storages, group_name, region_offset)
        into.append(new)
        if after:
            anchor = new
    return anchor


def _copy_inputs(graph: Graph, inputs: list[Node], after: Optional[list[Node]], c: int,
                 storages: dict) -> list[Node]:
    """Copy `c`'s own inputs, standing for the template's `inputs`, after the copy before's."""
    anchor = (after or inputs)[-1]
    made = []
    for p in inputs:
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(f"{p.target}_stamp{c}")
        anchor.meta = dict(p.meta)
        _own_meta(p, anchor, storages, "", 0)
        made.append(anchor)
    return made


def _own_meta(node: Node, new: Node, storages: dict, group_name: str, region_offset: int) -> None:
    """A copy's own fake tensors, aliasing one another as the template's do (`storages`: the
    template's storage -> the copy's, None for one shared with nodes outside the template), its own
    group name and checkpoint region."""
    if isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        new.meta["val"] = tree_map_only(torch.Tensor, lambda t: _fresh_like(t, storages), node.meta["val"])
    custom = node.meta.get("custom")
    if custom and GROUP_KEY in custom:
        # a block sharded over several meshes has a group per mesh: the copy's keeps the mesh
        new.meta["custom"] = {**custom, GROUP_KEY: group_name + split_mesh_suffix(custom[GROUP_KEY])[1]}
    if "ac_graph_id" in node.meta:
        new.meta["ac_graph_id"] = node.meta["ac_graph_id"] + region_offset


def _shared_storages(graph: Graph, template: _Block) -> set:
    """The storages of tensors outside the template (a view of one stays a view of it in a copy)."""
    mine = {*template.nodes, *template.inputs}
    shared = set()
    for node in graph.nodes:
        if node not in mine:
            tree_map_only(torch.Tensor, lambda t: shared.add(StorageWeakRef(t.untyped_storage())), node.meta.get("val"))
    return shared


def _fresh_like(t: torch.Tensor, storages: dict) -> torch.Tensor:
    """A fake tensor like `t` on the copy's storage for `t`'s (made at the first tensor that views
    it): one op where `t` is the first and spans its whole storage, as most values do."""
    key = StorageWeakRef(t.untyped_storage())
    base = storages.get(key, t)
    if base is None:
        return t
    with t.fake_mode:
        if base is t:  # the first of its storage in this copy
            nbytes = t.untyped_storage().nbytes()
            if t.storage_offset() == 0 and nbytes == _spanned_bytes(t):
                storages[key] = fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                return fresh
            storages[key] = base = torch.empty(nbytes, dtype=torch.uint8, device=t.device)
        if base.dtype != t.dtype:
            base = torch.empty(0, dtype=t.dtype, device=t.device).set_(base.untyped_storage())
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _spanned_bytes(t: torch.Tensor) -> int:
    """The bytes from `t`'s first element to its last, as strided."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()
