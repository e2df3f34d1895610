"""Which blocks are of one kind: a trace reuses the region body of a kind's first block for the
next ([Note: Every block a compile region] in traced/regions.py). A kind is what a block's code
may branch on (`kind_of`), and the numbers its first block's trace guarded on.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from enum import Enum
from typing import Any, Optional

import torch
import torch.nn as nn

from .state import region_state

_FLAG_TYPES = (bool, str, type(None), Enum)


def kind_of(module: nn.Module) -> str:
    """What blocks of one kind share, as they are now: the classes of their submodules, the Python
    flags those hold (each bool, string, None or enum attribute, which code branches on; of a number
    only its type, as a layer index differs from block to block), and the parameters' shapes and
    dtypes ([Note: Every block a compile region] in traced/regions.py)."""
    parts = []
    for path, m in module.named_modules():
        flags = [
            f"{name}={value!r}" if isinstance(value, _FLAG_TYPES) else f"{name}:{type(value).__name__}"
            for name, value in vars(m).items()
            if isinstance(value, _FLAG_TYPES + (int, float))
        ]
        parts.append(f"{path}:{type(m).__module__}.{type(m).__qualname__}({','.join(flags)})")
    return f"{';'.join(parts)};{[(tuple(p.shape), p.dtype) for p in module.parameters()]}"



@dataclasses.dataclass
class _KindTraced:
    """A kind of block the trace under way traced inline: its first block's `region_id` (`first`,
    not the module, which the record would keep alive) and name from the root, the names of
    Dynamo's guards before its trace (`guards_before`), then the attributes of the block that trace
    guarded the values of (`guarded`, read at the next block of the kind), and the values of those
    attributes of the blocks traced inline so far (`inline`). `node_before`: the graph's last node
    before its trace, until the next block of the kind reads `reads_free_numbers` from the nodes
    after it ([Note: Numbers a region cannot take from outside])."""

    first: int
    name: str
    guards_before: frozenset
    node_before: Optional[torch.fx.Node]
    guarded: Optional[tuple] = None
    reads_free_numbers: bool = False
    inline: set = dataclasses.field(default_factory=set)


# The trace now under way (its TracingContext, which Dynamo makes anew for every attempt at a frame)
# -> {kind: _KindTraced}. Keyed by the trace itself, not by its compile id: Dynamo numbers frames
# from 0 again after `torch._dynamo.reset()`, and another model's trace must never read this one's.
_kinds_traced: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@torch._dynamo.assume_constant_result
def seen(region_id: int, layout: str) -> bool:
    """Whether the trace under way already traced a block of this kind (`kind_of` of the block of
    the state `region_id` names), called with arguments of this layout (`flat_call`), inline,
    with the values of the attributes that block's trace guarded on; if not, it will now. Dynamo
    runs it as plain Python while it traces ([Note: Every block a compile region]). It takes
    constants, not the module: a module argument would leave a guard on the block's identity, which
    fails Dynamo's reuse of the next block's region. So the kind is read here, from the block as it
    is now, outside the trace."""
    trace = torch._guards.TracingContext.try_get()
    if trace is None:  # no trace under way: nothing traced before to reuse
        return False
    if trace not in _kinds_traced:
        _kinds_traced.clear()  # one trace at a time: only the one under way is kept
        _kinds_traced[trace] = {}
    state = region_state(region_id)
    block = state.modules[0]
    kind = (kind_of(block), layout)
    traced_kind = _kinds_traced[trace].get(kind)
    if traced_kind is None:
        _kinds_traced[trace][kind] = _KindTraced(region_id, state.name, _guard_names(), _last_node())
        return False
    if traced_kind.guarded is None:  # [Note: Numbers a block's trace guarded on]
        added = _guard_names() - traced_kind.guards_before
        traced_kind.guarded = _attributes_guarded(traced_kind.name, added)
        traced_kind.reads_free_numbers = _reads_free_numbers(traced_kind.node_before)
        traced_kind.node_before = None  # the graph is the trace's, not the record's
        first = region_state(traced_kind.first)
        if first is not None:
            traced_kind.inline.add(_values(first.modules[0], traced_kind.guarded))
    if traced_kind.reads_free_numbers:  # [Note: Numbers a region cannot take from outside]
        return False
    values = _values(block, traced_kind.guarded)
    if values in traced_kind.inline:
        return True
    traced_kind.inline.add(values)
    return False


# [Note: Numbers a block's trace guarded on]
# A block's kind holds no numbers (a layer index differs in every block), yet a block's code may
# branch on one: `if self.index % 2: ...` sends every other block another way, into a graph break
# for instance, which torch makes an error inside a region. Dynamo guards on every value the code
# took as a constant, so the guards the kind's first block's inline trace added name the numbers
# its code read: those on the block's own attributes (a source below the block's name, compared by
# value: CONSTANT_MATCH, EQUALS_MATCH). Read at the kind's next block, these attributes' values join
# the kind: a block whose values no block traced inline had goes inline too, as the first of its
# own kind. A layer index the code does not read (a Llama's, without a cache) leaves no guard, and
# its blocks stay one kind. What the code reads outside the block (global state) is not covered,
# but for a number Dynamo left symbolic: [Note: Numbers a region cannot take from outside].

# [Note: Numbers a region cannot take from outside]
# A number Dynamo does not take as a constant (a module-level float the script changed between
# steps, which Dynamo compiles again unspecialized) enters the graph as a tensor input and its
# `.item()`, a float with no source of its own. A region body that reads it takes that `.item()`
# from the enclosing graph, and torch 2.13 cannot reuse such a body: Dynamo raises "Freevar has no
# source" at the region's first call; a marked region fails too, under torch.compile alone
# (examples/repro/region_module_level_float.py).
# A symbolic int is reused fine. So a kind whose first block's inline trace used a symbolic float
# or bool that is not a graph input is traced inline in every block, as with regions="marked".
# What the trace did between that block and the kind's next one counts too (the root reading the
# number between two blocks): its blocks go inline, which costs compile time, never numbers.


def _last_node() -> Optional[torch.fx.Node]:
    """The last node of the graph Dynamo is building now (None outside a trace)."""
    tx = getattr(torch._dynamo.symbolic_convert.tls, "current_tx", None)
    if tx is None:
        return None
    return tx.output.current_tracer.graph._root.prev  # the graph's sentinel where it is empty


def _reads_free_numbers(node_before: Optional[torch.fx.Node]) -> bool:
    """Whether a node after `node_before` is, or uses, a symbolic float or bool with no graph input
    behind it ([Note: Numbers a region cannot take from outside])."""
    if node_before is None:
        return False
    node = node_before.next
    while node.op != "root":
        if any(_free_number(n) for n in (node, *node.all_input_nodes)):
            return True
        node = node.next
    return False


def _free_number(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, torch.SymBool)) and "grapharg" not in node.meta


_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
_ATTRIBUTE_STEP = re.compile(r"\._modules\['([^']+)'\]|\.(\w+)")


def _guard_names() -> frozenset:
    """The names of the value guards Dynamo's trace under way installed so far: (source, kind)."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return frozenset()
    return frozenset((g.name, g.create_fn_name()) for g in context.guards_context.dynamo_guards
                     if g.create_fn_name() in _VALUE_GUARDS)


def _attributes_guarded(name: str, guards: frozenset) -> tuple:
    """The attribute paths below block `name` (its FQN from the root) that `guards` compare by
    value, each as its steps: ("_modules", "self_attn"), ("attr", "layer_idx")."""
    below = "".join(f"._modules['{part}']" for part in name.split("."))
    paths = set()
    for source, _ in guards:
        at = source.find(below)
        if at < 0:
            continue
        rest = source[at + len(below):]
        steps = list(_ATTRIBUTE_STEP.finditer(rest))
        if rest and "".join(m.group(0) for m in steps) == rest:  # nothing but attribute steps
            paths.add(tuple(("_modules", m.group(1)) if m.group(1) is not None else ("attr", m.group(2)) for m in steps))
    return tuple(sorted(paths))


def _values(block: nn.Module, paths: tuple) -> tuple:
    """The values of `paths` (`_attributes_guarded`) on `block`, as their reprs ("-" where one is
    missing)."""
    values = []
    for path in paths:
        value = block
        for how, key in path:
            value = value._modules.get(key) if how == "_modules" else getattr(value, key, None)
            if value is None:
                break
        values.append(repr(value) if value is not None else "-")
    return tuple(values)


