"""Run graph passes in order, each switchable off by name, with a dump before and after each one.

Every pass has one signature, `(gm: GraphModule) -> GraphModule`; its options are bound with
`functools.partial` when the pipeline is built. The runner logs each pass's op-count change.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from torch.fx import GraphModule

logger = logging.getLogger(__name__)


class GraphSink(Protocol):
    """Where the runner writes graphs (see fsdp_graph/inspect/dump.py)."""

    def write_graph(self, gm: GraphModule, label: str) -> None: ...


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
                continue
            before = _op_counts(gm)
            if self.sink is not None:
                self.sink.write_graph(gm, f"{label}.before")
            gm = graph_pass.fn(gm)
            if self.sink is not None:
                self.sink.write_graph(gm, f"{label}.after")
            logger.debug("fsdp_graph::pass (%s): %s", label, _diff(before, _op_counts(gm)))
        return gm
