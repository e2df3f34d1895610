"""A graph reduced to what the simulator reads (passes/simulator.py): its nodes in order, each
an `Op` with machine-independent facts and the names of the nodes it reads. Plain data, written to
dumps as JSON. Simulated time is kept in ticks: [Note: Exact simulated time] in passes/simulator.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Optional

from .cost_model import CollectiveKind, OpFacts
from .nodes import is_tangent_name


class OpKind(Enum):
    INPUT = "input"
    COMPUTE = "compute"
    VIEW = "view"
    COLLECTIVE = "collective"
    WAIT = "wait"
    OUTPUT = "output"


@dataclass
class Op:
    """One node of a `Program`. Attributes:
    name: the FX node's name.
    kind: an `OpKind`.
    target: the op, short (`aten.mm`), for display.
    inputs: names of the nodes it reads, in order.
    out_bytes: bytes of its output (0 for the output node).
    facts: what it does (flops, bytes, collective) -- see `OpFacts`.
    group: the fsdp_graph group of a collective, e.g. "layers.3".
    scratch_bytes: what a collective holds besides its output from its issue to its wait (gloo's
        copies; `_gloo_scratch_bytes`); what a compile region's call holds while it runs (its body's
        peak, outputs included; `_region_scratch_bytes`).
    storage_of: the node whose storage its output is, so that it allocates nothing of its own: an
        `out=` argument (gloo's all-gathers after passes/gloo.py), or for a backward's saved input an
        earlier saved input viewing the same tensor (`_size_saved_storages`). Its own name on a
        `getitem` of a compile region's call, which is a tensor of its own (`_region_output`).
    """

    name: str
    kind: OpKind
    target: str
    inputs: list[str]
    out_bytes: int = 0
    facts: OpFacts = field(default_factory=OpFacts)
    group: Optional[str] = None
    scratch_bytes: int = 0
    storage_of: Optional[str] = None

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind.value, "target": self.target, "inputs": self.inputs,
                "out_bytes": self.out_bytes, "facts": _facts_to_json(self.facts), "group": self.group,
                "scratch_bytes": self.scratch_bytes, "storage_of": self.storage_of}

    @classmethod
    def from_json(cls, data: dict) -> "Op":
        return cls(data["name"], OpKind(data["kind"]), data["target"], list(data["inputs"]), data["out_bytes"],
                   _facts_from_json(data["facts"]), data.get("group"), data.get("scratch_bytes", 0), data.get("storage_of"))


def _facts_to_json(facts: OpFacts) -> dict:
    data = {f.name: getattr(facts, f.name) for f in fields(facts)}
    data["collective"] = facts.collective.value if facts.collective else None
    data["parts"] = [_facts_to_json(part) for part in facts.parts]
    return data


def _facts_from_json(data: dict) -> OpFacts:
    data = dict(data)
    data["collective"] = CollectiveKind(data["collective"]) if data["collective"] else None
    data["parts"] = tuple(_facts_from_json(part) for part in data.get("parts", ()))
    return OpFacts(**data)


Program = list[Op]

TICKS_PER_S = 1 << 100  # see [Note: Exact simulated time]


def ticks(seconds: float) -> int:
    """`seconds` as whole ticks: exact for any float above 2**-48 s."""
    return round(math.ldexp(seconds, 100))


def seconds(num_ticks: int) -> float:
    """Ticks as float seconds, correctly rounded."""
    return num_ticks / TICKS_PER_S


def _allocates_apart(op: Op) -> bool:
    return op.kind is OpKind.VIEW and op.storage_of == op.name


def saved_inputs(program: Program) -> frozenset[str]:
    """The inputs of a backward program (one with incoming gradients, `tangents_*`) that its forward
    saved for it: activations, recomputation's inputs. Parameters (`primals_*`, resident anyway) and
    the incoming gradients are not; a forward has none."""
    inputs = [op.name for op in program if op.kind is OpKind.INPUT]
    if not any(is_tangent_name(name) for name in inputs):
        return frozenset()
    return frozenset(name for name in inputs if not (name.startswith("primals") or is_tangent_name(name)))
