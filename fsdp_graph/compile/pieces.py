"""Compile a scheduled forward or backward graph piece by piece, each piece's code once.

[Note: Pieces between the collectives]
Inductor lowers, schedules and generates code for every node of the graph it is given, and the
whole-step graph holds every layer: its cost grows with depth where FSDP2 + `torch.compile(model)`,
whose graphs break at every block, compiles one block and reuses it. Here the scheduled graph is cut
at its collectives and waits: those stay in an outer program, run in the planned order, and the runs
of computation between them become pieces that Inductor compiles. Blocks of the same code, shapes and
schedule give pieces that differ only in their node names; pieces are compared by structure
(`piece_key`), and each structure is compiled once, its compiled code run for every piece of it.
A run that launches one kernel is no piece: the outer program runs it ([Note: Pieces too small to
compile]), as it makes the collectives' fresh buffers ([Note: A collective's fresh buffer is no part of
a piece]).

The outer program runs the collectives as the compiled graph would have (Inductor calls the same
functional collectives as extern kernels), in the graph's order, which is the schedule: nothing can
move a collective across a piece, so no ordering edges are needed (the `pin_order` pass is skipped).
Every value is dropped after its last use, as Inductor's code frees buffers. Each piece keeps the
strides its values have in the graph, since the piece after it was compiled for them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx.passes.fake_tensor_prop
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import SymExprPrinter, free_symbols
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg
from torch._dynamo.utils import counters
from torch._inductor.output_code import OutputCode
from torch._inductor.utils import BoxedBool

from .cache_key import KeyOnly, own_sources_digest
from .cpu_probe import wait_for_cpu_probe
from ..passes.cost_model import is_view
from ..passes.nodes import inline_regions

logger = logging.getLogger(__name__)

_OUTSIDE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})


def _stays_outside(node: Node) -> bool:
    """A collective, a wait, or an item of one's result: run by the outer program, in order."""
    if node.op == "get_attr":  # a constant of the graph: in the piece that reads it
        return False
    if node.op != "call_function":
        return True
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, Node) and _stays_outside(source)
    namespace = getattr(target, "namespace", None)
    return namespace in _OUTSIDE_NAMESPACES


@dataclass
class _Piece:
    """A run of computation between two collectives: its nodes in order, the values it reads
    from outside (first use first) and those read after it."""

    nodes: list[Node]
    inputs: list[Node]
    outputs: list[Node]

    @functools.cached_property
    def key(self) -> str:
        return piece_key(self)


def split_pieces(gm: GraphModule) -> list:
    """The graph's nodes in order, consecutive computation grouped into `_Piece`s; collectives,
    waits, placeholders and the output stay single nodes."""
    steps: list = []
    current: list[Node] = []
    buffers: list[Node] = []  # [Note: A collective's fresh buffer is no part of a piece]
    for node in gm.graph.nodes:
        if not _stays_outside(node):
            (buffers if _fresh_buffer_for_collectives(node) else current).append(node)
            continue
        if current:
            steps.append(current)
            current = []
        steps.extend(buffers)
        buffers = []
        steps.append(node)
    if current:
        steps.append(current)
    steps.extend(buffers)
    symbols = _symbol_inputs(gm)
    runs: list = []  # single nodes for the outer program, and (run of computation, its inputs)
    read_elsewhere: set[Node] = set()  # values that define a symbol a later piece reads
    for step in steps:
        if not isinstance(step, list):
            runs.append(step)
            continue
        if _too_small_to_compile(step):
            runs.extend(step)  # [Note: Pieces too small to compile]: the outer program runs its ops
            continue
        members = set(step)
        inputs: dict[Node, None] = {}
        for node in step:
            for arg in node.all_input_nodes:
                if arg not in members:
                    inputs.setdefault(arg)
        if symbols:
            # every size symbol the piece's values use comes in as a number of its own, so that
            # Inductor can bind it where no input has it as a whole size (2 * s0 only)
            used = set().union(*(free_symbols(n.meta.get("val")) for n in (*inputs, *step)))
            for symbol in sorted(used, key=str):
                if symbol in symbols and symbols[symbol] not in members:
                    inputs.setdefault(symbols[symbol])
                    read_elsewhere.add(symbols[symbol])
        runs.append((step, inputs))
    pieces = []
    for run in runs:
        if not isinstance(run, tuple):
            pieces.append(run)
            continue
        step, inputs = run
        members = set(step)
        outputs = [n for n in step if n in read_elsewhere or any(u not in members for u in n.users)]
        pieces.append(_Piece(step, list(inputs), outputs))
    return pieces


# [Note: Values between pieces are dense]
# Inductor keeps the strides the graph gives a piece's outputs where the value is dense, but of a
# view with gaps (`x.view(2, 4, 4).diagonal(dim1=1, dim2=2)`: strides (16, 5)) it keeps only the
# order of the strides, and returns a dense copy, (4, 1). The next piece, compiled for the graph's
# strides, then refuses its input (`assert_size_stride`). So such a value is copied dense at the end
# of the piece that makes it, and every later piece, collective and output reads the copy: the same
# numbers, in the layout both sides expect. Values inside a piece are left as they are.


def dense_between_pieces(gm: GraphModule) -> int:
    """Give every value that leaves a piece with gaps in its strides a dense copy, read by all of its
    users outside the piece ([Note: Values between pieces are dense]); the views of a copy lose their
    fake values, to be computed again. Returns how many."""
    copies = set()
    for step in split_pieces(gm):
        if not isinstance(step, _Piece):
            continue
        members = set(step.nodes)
        for node in step.outputs:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or torch._prims_common.is_non_overlapping_and_dense_or_false(val):
                continue
            with gm.graph.inserting_after(node):
                dense = gm.graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
            dense.meta["val"] = val.clone(memory_format=torch.contiguous_format)
            node.replace_all_uses_with(dense, delete_user_cb=lambda user: user is not dense and user not in members)
            copies.add(dense)
    if copies:
        _drop_values_of_views(gm, copies)
        gm.recompile()
    return len(copies)


# [Note: Pieces too small to compile]
# Between two collectives there is sometimes a single op: the division of a reduced row by the
# world size, a select of its flags. Inductor makes that one op one kernel, as eager does, and still
# pays a whole compile for it (a C++ build each on CPU), once per distinct shape (docs/benchmarks.md, session 32 under "Compile cost against depth"). So a run of
# computation that launches at most one kernel (its other ops are views) is no piece: the outer
# program runs its ops one by one, as it runs the collectives, and a step with it stored in
# AOTAutograd's cache names them by op (`_OpName`). Ops that draw random numbers stay in pieces,
# where Inductor's generator draws them, and so does anything that is not an op overload returning
# one tensor (a getitem, a Python operator on sizes, a constant).
_VIEW_LIKE = frozenset({torch.ops.aten._unsafe_view.default})


def _runs_as_one_op(node: Node) -> bool:
    """Whether the outer program can run the node as it is: an op overload with one tensor for its
    value, drawing no random numbers."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in target.tags
            and isinstance(node.meta.get("val"), torch.Tensor))


def _too_small_to_compile(nodes: list[Node]) -> bool:
    """Whether a run of computation launches at most one kernel: every node runs as one op
    (`_runs_as_one_op`), and all but one of them are views."""
    if not all(_runs_as_one_op(node) for node in nodes):
        return False
    return sum(not (node.target.is_view or node.target in _VIEW_LIKE) for node in nodes) <= 1


# [Note: A collective's fresh buffer is no part of a piece]
# The gather of the next group writes into a buffer made for it (`empty`), and the schedule makes
# that buffer where the gather is issued, often in the middle of a block's computation. Were it part
# of the piece, the block before each gather of a different size would be a piece of its own (the
# buffer's size is in the piece's key): the last blocks before the model's head, each compiled again.
# A node that reads no value and is read by collectives alone is run by the outer program instead,
# after the run of computation it sat in and before its collective: made later than the schedule
# made it, never earlier, so it holds its memory no longer.
def _fresh_buffer_for_collectives(node: Node) -> bool:
    """Whether the node makes a tensor from nothing (an op run as it is, reading no value) that only
    collectives read."""
    return (_runs_as_one_op(node) and not node.all_input_nodes
            and bool(node.users) and all(_stays_outside(user) for user in node.users))


def _symbol_inputs(gm: GraphModule) -> dict:
    """The values that are a size symbol, by symbol: the graph's inputs, and the numbers read from
    tensors in it (unbacked: `.tolist()` of a router's counts, which size an all-to-all)."""
    found = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            found.setdefault(val.node.expr, node)
    return found


def _meta_repr(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{value.device},{tuple(value.shape)},{value.stride()},{value.storage_offset()})"
    return f"V({type(value).__name__},{value})"


def piece_graph(piece: _Piece) -> GraphModule:
    """The piece as a graph of its own, with canonical names: inputs `in<i>`, values `v<i>`, so that
    pieces of the same structure print alike (and meet in the FX graph cache)."""
    graph = Graph()
    root = torch.nn.Module()
    env: dict[Node, Node] = {}
    items: dict[Node, list[Node]] = {}
    for i, node in enumerate(piece.inputs):
        arity = _arity(node)
        if arity is None:
            placeholder = graph.placeholder(f"in{i}")
            placeholder.meta["val"] = node.meta.get("val")
            env[node] = placeholder
            continue
        # a list of tensors enters the piece as its items
        items[node] = []
        for k in range(arity):
            placeholder = graph.placeholder(f"in{i}_{k}")
            placeholder.meta["val"] = node.meta["val"][k]
            items[node].append(placeholder)
        env[node] = items[node]
    for i, node in enumerate(piece.nodes):
        if node.target is operator.getitem and node.args[0] in items:
            env[node] = items[node.args[0]][node.args[1]]
            continue
        target = node.target
        if node.op == "get_attr":  # the constant, under the value's own name in the piece
            target = f"v{i}"
            setattr(root, target, operator.attrgetter(node.target)(node.graph.owning_module))
        copy = graph.create_node(
            node.op, target, map_arg(node.args, env.__getitem__), map_arg(node.kwargs, env.__getitem__), name=f"v{i}",
        )
        copy.meta = dict(node.meta)
        env[node] = copy
    flat = []
    for node in piece.outputs:
        arity = _arity(node)
        if arity is None:
            flat.append(env[node])
            continue
        for k in range(arity):  # a list of tensors leaves the piece as its items
            item = graph.call_function(operator.getitem, (env[node], k))
            item.meta["val"] = node.meta["val"][k]
            flat.append(item)
    out = graph.output(tuple(flat))
    # every output keeps its graph strides: the next piece was compiled for them
    out.meta["user_visible_output_idxs"] = list(range(len(flat)))
    return GraphModule(root, graph)


def _arity(node: Node) -> Optional[int]:
    """How many items the node's value has, when it is a list or tuple; None for one value."""
    val = node.meta.get("val")
    return len(val) if isinstance(val, (list, tuple)) else None


def piece_key(piece: _Piece) -> str:
    """What a piece's compiled code depends on: its ops and their arguments by position, and the
    metadata of its inputs."""
    index = {n: f"in{i}" for i, n in enumerate(piece.inputs)}
    index.update({n: f"v{i}" for i, n in enumerate(piece.nodes)})
    parts = [_meta_repr(n.meta.get("val")) for n in piece.inputs]
    for node in piece.nodes:
        args = map_arg((node.args, node.kwargs), lambda n: index[n])
        parts.append(f"{node.target}{args!r}")
    parts.append(repr([index[n] for n in piece.outputs]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class PieceProgram(OutputCode):
    """Runs the outer program: collectives and waits as calls, pieces through their compiled code;
    each value dropped after its last use. Called boxed, like Inductor's compiled graphs. An
    `OutputCode`, so that AOTAutogradCache can store it (bundled: [Note: A step of pieces in
    AOTAutograd's cache]): the pieces go as Inductor's serialized graphs, the calls by op name."""

    def __init__(self, gm: GraphModule, pieces: list, compiled: dict[str, Any], output_strides: list) -> None:
        super().__init__()
        self._boxed_call = True  # on the instance: wrappers copy the instance's __dict__
        self.pieces = list(compiled.values())
        position = {key: i for i, key in enumerate(compiled)}
        self.output_strides = _print_strides(output_strides)  # as Inductor keeps them: stored and loaded as text
        slots: dict[Node, int] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, n in enumerate(placeholders):
            slots[n] = i
        self.num_inputs = len(placeholders)
        steps = []
        output_nodes: set[Node] = set()
        for step in pieces:
            if isinstance(step, _Piece):
                ins = [(slots[n], _arity(n)) for n in step.inputs]
                for n in step.outputs:
                    slots[n] = len(slots)
                outs = [(slots[n], _arity(n)) for n in step.outputs]
                steps.append((position[step.key], ins, outs, step.inputs))
            elif step.op == "call_function":
                args = map_arg((step.args, step.kwargs), lambda n: _Slot(slots[n]))
                slots[step] = len(slots)
                steps.append((step.target, args, [(slots[step], None)], step.all_input_nodes))
            elif step.op == "output":
                self.output = map_arg(step.args[0], lambda n: _Slot(slots[n]))
                output_nodes = set(step.all_input_nodes)
        self.num_slots = len(slots)
        # each value is dropped after the step that reads it last
        last: dict[int, int] = {}
        for k, (_, _, _, reads) in enumerate(steps):
            for n in reads:
                last[slots[n]] = k
        keep = {slots[n] for n in output_nodes}
        frees: list[list[int]] = [[] for _ in steps]
        for slot, k in last.items():
            if slot not in keep:
                frees[k].append(slot)
        self.steps = [(what, args, outs, frees[k]) for k, (what, args, outs, _) in enumerate(steps)]

    def __call__(self, args: list) -> Any:
        env: list = [None] * self.num_slots
        env[: self.num_inputs] = args
        args.clear()
        for what, ins, outs, frees in self.steps:
            if isinstance(what, int):
                flat = []
                for slot, arity in ins:
                    if arity is None:
                        flat.append(env[slot])
                    else:
                        flat.extend(env[slot])
                for slot in frees:  # the piece holds its inputs alone and frees each after its last use
                    env[slot] = None
                results = self.pieces[what](flat)
                k = 0
                for slot, arity in outs:
                    if arity is None:
                        env[slot] = results[k]
                        k += 1
                    else:
                        env[slot] = list(results[k:k + arity])
                        k += arity
            else:
                a, kw = _load(ins, env)
                env[outs[0][0]] = what(*a, **kw)
            for slot in frees:
                env[slot] = None
        return _load(self.output, env)

    # [Note: A step of pieces in AOTAutograd's cache]
    # AOTAutogradCache stores a compiled forward and backward either as keys into Inductor's FX
    # graph cache, which a program of pieces has none of, or, bundled, as the OutputCode itself,
    # pickled after `prepare_for_serialization` (on a shallow copy) and loaded with `post_compile`.
    # The backend turns bundling on for its own compiles with pieces (fsdp_graph/compile/backend.py).

    def prepare_for_serialization(self) -> None:
        pieces = []
        for piece in self.pieces:
            piece = copy.copy(piece)
            piece.prepare_for_serialization()
            pieces.append(piece)
        self.pieces = pieces  # the copy's own list: the running program keeps its callables
        self.steps = [(_OpName.of(what) if not isinstance(what, int) else what, args, outs, frees)
                      for what, args, outs, frees in self.steps]

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        from torch._inductor.codecache import FxGraphCache
        from torch._inductor.utils import set_tracing_context_output_strides

        wait_for_cpu_probe()  # loading a piece's C++ kernels asks for the CPU's vector ISA: [Note: The CPU probe in the background]
        with _step_context_hidden():
            for i, piece in enumerate(self.pieces):
                if piece.current_callable is None:
                    loaded, _ = FxGraphCache.cache_hit_post_compile(piece, {}, constants)
                    if loaded is None:
                        raise RuntimeError("fsdp_graph: a compiled piece could not be loaded")
                    loaded.post_compile([], constants, {**graph_kwargs, "cudagraphs": BoxedBool(False)})
                    self.pieces[i] = loaded
        set_tracing_context_output_strides(example_inputs, self)  # the step's, evaluated as Inductor's graphs do
        self.steps = [(what.resolve() if isinstance(what, _OpName) else what, args, outs, frees)
                      for what, args, outs, frees in self.steps]

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # each piece carries its own


@dataclass(frozen=True)
class _OpName:
    """An op by name, for pickling (torch's op overloads do not pickle)."""

    namespace: str
    name: str
    overload: str

    @classmethod
    def of(cls, op: Any) -> "_OpName":
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"fsdp_graph: cannot save a program that calls {op!r}")
        return cls(op.namespace, op._schema.name.split("::")[-1], op._overloadname)

    def resolve(self) -> Any:
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


@dataclass(frozen=True)
class _Slot:
    index: int


def _load(template: Any, env: list) -> Any:
    if isinstance(template, _Slot):
        return env[template.index]
    if isinstance(template, (list, tuple)):
        return type(template)(_load(t, env) for t in template)
    if isinstance(template, dict):
        return {k: _load(v, env) for k, v in template.items()}
    return template


def compile_pieces(gm: GraphModule, compile_piece: Callable[[GraphModule, list], Callable]) -> PieceProgram:
    """Cut `gm` at its collectives, compile each distinct piece with `compile_piece(graph,
    example_inputs)`, and return the program that runs them. Counts both in torch's counters
    (`torch._dynamo.utils.counters["fsdp_graph"]`: "pieces", "pieces_compiled")."""
    pieces = split_pieces(gm)
    runs = [step for step in pieces if isinstance(step, _Piece)]
    distinct: dict[str, _Piece] = {}
    for step in runs:
        distinct.setdefault(step.key, step)
    keys = list(distinct)
    # [Note: Each rank compiles its own share of the pieces first]: every n-th piece, then the rest
    local_rank, local_size = _local_rank()
    compiled: dict[str, Callable] = {}
    for i in sorted(range(len(keys)), key=lambda i: i % local_size != local_rank):
        key = keys[i]
        step = distinct[key]
        inputs = []
        for node in step.inputs:
            val = node.meta.get("val")
            inputs.extend(val if _arity(node) is not None else [val])
        compiled[key] = compile_piece(piece_graph(step), inputs)
    compiled = {key: compiled[key] for key in keys}  # back in the graph's order: the same program on every rank
    counters["fsdp_graph"]["pieces"] += len(runs)
    counters["fsdp_graph"]["pieces_compiled"] += len(compiled)
    logger.debug("fsdp_graph::pieces %d pieces, %d compiled", len(runs), len(compiled))
    return PieceProgram(gm, pieces, compiled, graph_output_strides(gm))


def _local_rank() -> tuple[int, int]:
    """This rank's place among the ranks that share its compile caches, and their number.

    [Note: Each rank compiles its own share of the pieces first]
    Every rank of a node compiles the same pieces into one cache directory, and Inductor builds each
    C++ kernel under a file lock, so ranks that go through the pieces in one order queue behind each
    other: one builds, the others wait for the lock and load what it built. Each local rank compiles
    every n-th piece first instead, then the rest: the ranks build different kernels at once, and a
    rank that comes to a piece another rank has finished loads it from the FX graph cache (a piece's
    key holds no rank) or its kernels from the C++ cache. The order changes what runs when, not what
    any piece compiles to."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    # the ranks sharing a cache directory are those of one node: torchrun says which they are
    size = max(int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size())), 1)
    return int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())) % size, size


def compile_in_pieces(schedule: Callable[[Graph], None], gm: GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """Inductor's inner compiler for a scheduled graph in pieces: `schedule` runs our scheduling and
    lowering passes on the graph (without `pin_order`), then each distinct piece goes through
    `compile_fx_inner` with the keyword arguments AOTAutograd gave for the whole graph, and its
    inputs' fake values. Inductor's own post-grad passes run on each piece.

    [Note: A piece donates none of its inputs]
    AOTAutograd tells Inductor which inputs of a backward graph are donated: saved activations that
    nothing else holds, whose buffers the backward's kernels may overwrite once they last read them.
    It says so by their number among the step's inputs, through the tracing context, and a piece's
    compile would read those numbers as its own inputs': any value at such a place, one a later
    piece still reads included, could be overwritten (torchtitan's Llama trained on a wrong
    gradient). The numbers are hidden while the pieces compile (`_step_context_hidden`), so no
    piece overwrites an input; the program frees each value after its last reader instead."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    schedule(gm.graph)
    inline_regions(gm)
    _views_of_restrided_inputs_anew(gm, example_inputs)
    _propagate_new_values(gm, example_inputs)
    if dense_between_pieces(gm):
        _propagate_new_values(gm, example_inputs)  # the views of the dense copies
    # Our passes ran on the step: their keys (the joint pass's holds this rank's shard shapes) are no
    # part of a piece's, so that ranks with the same piece share its cache entry. It holds our
    # sources' digest instead (how a piece is compiled is ours), the same on every rank.
    piece_key = KeyOnly(f"fsdp_graph.piece:{own_sources_digest()[:16]}")

    def compile_piece(graph: GraphModule, inputs: list) -> Callable:
        # Inductor skips its FX graph cache while AOTAutograd bundles its entries; a piece uses it, so
        # that where AOTAutogradCache cannot serve the step (it refuses torchtitan's selective
        # checkpointing), a relaunch still loads every piece. A piece without calls compiles to
        # a plain function unless bundling is on: it stays on for those.
        caching = {"bundled_autograd_cache": False} if any(n.op == "call_function" for n in graph.graph.nodes) else {}
        with inductor_config.patch(post_grad_custom_post_pass=piece_key, joint_custom_pre_pass=None), functorch_config.patch(caching):
            return compile_fx_inner(
                graph, inputs, cudagraphs=BoxedBool(False), static_input_idxs=(),
                is_backward=kwargs.get("is_backward", False), is_inference=kwargs.get("is_inference", False),
                graph_id=kwargs.get("graph_id"),
            )

    with _step_context_hidden():
        program = compile_pieces(gm, compile_piece)
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides is not None:
        context.output_strides.extend(graph_output_strides(gm))  # every piece keeps the step's
    return program


class _NewValues(torch.fx.passes.fake_tensor_prop.FakeTensorProp):
    """Fake values for the nodes that have none: a node with a value keeps it, and its users
    compute theirs from it."""

    def run_node(self, n: Node) -> Any:
        if n.op != "placeholder" and "val" in n.meta:
            return n.meta["val"]
        return super().run_node(n)


def _views_of_restrided_inputs_anew(gm: GraphModule, example_inputs: list) -> None:
    """Drop the fake values of the views of every input whose strides AOTAutograd changed, so that
    `_propagate_new_values` computes them again from the input as it comes.

    A backward's saved activations arrive with the strides the forward's program gave them, which
    AOTAutograd puts on the backward's example inputs: a forward piece returns a view with gaps
    dense ([Note: Values between pieces are dense]). The graph's own values were traced with the
    strides of the joint graph; a view of such an input computed by the program (a transpose of
    the router's gates) would then reach a piece compiled for strides it does not have."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    stale = set()
    for node, example in zip(placeholders, example_inputs):
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(example, torch.Tensor)):
            continue
        strides = (tuple(val.stride()), tuple(example.stride()))
        if all(isinstance(s, int) for pair in strides for s in pair) and strides[0] != strides[1]:
            stale.add(node)
    _drop_values_of_views(gm, stale)


def _drop_values_of_views(gm: GraphModule, changed: set) -> None:
    """Drop the fake values of every view (of a view ...) of the nodes `changed`, whose strides
    changed: `_propagate_new_values` computes them again."""
    stale = set(changed)
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_view(node) and any(a in stale for a in node.all_input_nodes):
            node.meta.pop("val", None)
            stale.add(node)


def _propagate_new_values(gm: GraphModule, example_inputs: list) -> None:
    """Fake values for the nodes our passes made, which the pieces' inputs and keys read. AOTAutograd
    traced every other node with its value, so only the new ones are computed: a full propagation
    would dispatch every op of the step again."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import fake_tensor_prop

    mode = detect_fake_mode(example_inputs)
    if mode is None:  # real inputs: Inductor makes a fake mode for them
        with torch.no_grad():
            fake_tensor_prop(gm, example_inputs, True)
        return
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True  # constants of the graph
    try:
        with torch.no_grad(), enable_python_dispatcher():
            _NewValues(gm, mode=mode).propagate_dont_convert_inputs(*example_inputs)
    finally:
        mode.allow_non_fake_inputs = allowed


@contextlib.contextmanager
def _step_context_hidden():
    """Inductor reads two things of the step from the tracing context that a piece must not see:
    the list through which a compiled graph reports its output strides (each piece's compile or
    load would report its own; the caller reports the step's, which every piece keeps), and the
    backward's donated inputs, by their number among the step's inputs ([Note: A piece donates
    none of its inputs]). Both are hidden while the pieces compile or load."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        yield
        return
    reported, context.output_strides = context.output_strides, None
    metadata = context.fw_metadata
    donated = metadata.bw_donated_idxs if metadata is not None else None
    if metadata is not None:
        metadata.bw_donated_idxs = None
    try:
        yield
    finally:
        context.output_strides = reported
        if metadata is not None:
            metadata.bw_donated_idxs = donated


def graph_output_strides(gm: GraphModule) -> list:
    """The strides of the graph's outputs, None for an output that is not a tensor."""
    strides = []
    for value in gm.graph.output_node().args[0]:
        val = value.meta.get("val") if isinstance(value, Node) else None
        strides.append(tuple(val.stride()) if isinstance(val, torch.Tensor) else None)
    return strides


def _print_strides(strides: list) -> list:
    """The output strides as expressions in the graph's size symbols, as text."""
    printer = SymExprPrinter()
    return [None if s is None else tuple(printer.doprint(x.node.expr) if isinstance(x, torch.SymInt) else str(x) for x in s)
            for s in strides]
