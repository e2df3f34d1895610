"""Run graph passes in order: each switchable off by name, timed, and dumped before and after.

Every pass has one signature, `(gm: GraphModule) -> GraphModule`; its options are bound with
`functools.partial` when the pipeline is built (passes/table.py). The runner owns what every pass
would otherwise repeat: after a pass that changed the graph it lints and recompiles it once, it
writes the graph before and after each pass when dumping, and it measures the seconds each pass
took, which it logs, and which the dump's summary keeps for the inspector.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from torch.fx import GraphModule

logger = logging.getLogger(__name__)


class GraphSink(Protocol):
    """Where the runner writes graphs and pass times (see fsdp_graph/inspect/dump.py)."""

    def write_graph(self, gm: GraphModule, label: str) -> None: ...

    def record_pass(self, graph_id: str, stage: str, name: str, seconds: Optional[float]) -> None: ...


@dataclass(frozen=True)
class GraphPass:
    """Attributes:
    name: how the pass is named in logs, dumps and `disabled_passes`.
    fn: the pass itself.
    """

    name: str
    fn: Callable[[GraphModule], GraphModule]


def _op_counts(gm: GraphModule) -> collections.Counter:
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"
    )


def _diff(before: collections.Counter, after: collections.Counter) -> str:
    changes = []
    for op in sorted(set(before) | set(after)):
        if before[op] != after[op]:
            changes.append(f"{op} {before[op]}->{after[op]}")
    return ", ".join(changes) or "no op-count change"


def _code_shape(gm: GraphModule) -> list[tuple]:
    """What the generated code depends on: the nodes in order with their targets and arguments."""
    return [(n, n.target, n.args, n.kwargs) for n in gm.graph.nodes]


def _same_code(before: list[tuple], after: list[tuple]) -> bool:
    """Whether two `_code_shape`s are the same objects throughout. A node's `args` and `kwargs` are
    new objects whenever a pass sets them, so identity is enough, and it never compares the values
    (a tensor constant among the arguments would not compare to a bool)."""
    return len(before) == len(after) and all(x is y for b, a in zip(before, after) for x, y in zip(b, a))


def run_pass(fn: Callable[[GraphModule], GraphModule], gm: GraphModule) -> GraphModule:
    """Run one pass as the runner does: lint and recompile the graph if the pass changed it."""
    before = _code_shape(gm)
    out = fn(gm)
    if out is not gm or not _same_code(before, _code_shape(out)):
        out.graph.lint()
        out.recompile()
    return out


class PassPipeline:
    """An ordered list of passes over one kind of graph (e.g. the joint graph)."""

    def __init__(self, stage: str, passes: list[GraphPass], disabled: frozenset[str], sink: Optional[GraphSink]) -> None:
        self.stage = stage
        self.passes = passes
        self.disabled = disabled
        self.sink = sink

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __call__(self, gm: GraphModule, graph_id: str) -> GraphModule:
        for graph_pass in self.passes:
            label = f"{graph_id}.{self.stage}.{graph_pass.name}"
            if graph_pass.name in self.disabled:
                logger.debug("fsdp_graph::pass (%s) disabled", label)
                if self.sink is not None:
                    self.sink.record_pass(graph_id, self.stage, graph_pass.name, None)
                continue
            counting = logger.isEnabledFor(logging.DEBUG)
            before = _op_counts(gm) if counting else None
            if self.sink is not None:
                self.sink.write_graph(gm, f"{label}.before")
            start = time.perf_counter()
            gm = run_pass(graph_pass.fn, gm)
            seconds = time.perf_counter() - start
            if self.sink is not None:
                self.sink.write_graph(gm, f"{label}.after")
                self.sink.record_pass(graph_id, self.stage, graph_pass.name, seconds)
            if counting:
                logger.debug("fsdp_graph::pass (%s) %.3f s: %s", label, seconds, _diff(before, _op_counts(gm)))
        return gm
