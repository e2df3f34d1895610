"""Rank consistency under torch.compile: every rank puts the same collectives on the wire in the
same order, while Dynamo decides per rank what it traces, recompiles and runs eagerly.

This module owns the protocol: the states below, their transitions, and the decision the backend
asks for before it schedules a graph (`frame_order`). Each other file keeps one invariant of it:

- runtime/peer_log.py: each rank's append-only sequence of entries per set of ranks, in the default
  process group's store, one log per process group ([Note: One log per process group]); it also
  holds the marks of the sets of ranks that diverged in that process group, for every rank to see.
- passes/wire_order.py: computes a scheduled graph's wire order, and makes a graph issue a given one
  (`order_collectives_as`).
- runtime/wire_plan.py: a call that falls back to the eager hooks replays the frame's recorded wire
  order ([Note: A fallback keeps the frame's wire order]).
- fsdp_graph/compile/cache_key.py: names the file beside the compile caches that holds a frame's
  recorded orders (`wire_orders_file`), by what the compiled graph depends on.
- fsdp_graph/compile/backend.py: asks `frame_order` before it schedules a graph, schedules as told,
  and hands each scheduled graph to `FrameWireOrder.keep`.
- traced/hooks.py: tells the log of a group whose hooks first run eagerly inside a compiled call.

States. A set of ranks (those of the meshes a graph's parameters live on) is in one of the first
two, per default process group; a frame's graphs (per root context, backend options, groups and
grad mode) go through the others.

    state      entered when                                   a graph or call there
    ---------  ---------------------------------------------  ---------------------------------------
    agree      the process group's log begins                 a graph of several groups is told and
                                                              compared with the others' entry
    diverged   a rank found different graphs, and marked it   a graph of several groups is told, not
                                                              compared, and keeps program order
    first      Dynamo compiles a frame's first graph          asks (agree or diverged), is scheduled
                                                              as told, records its wire orders
    recorded   the first graph's forward and backward         the compiled graphs run; with Inductor
               orders are known                               the orders are also beside the caches
    recompile  Dynamo compiles a recorded frame again on      asks nobody; scheduled as usual, then
               one rank (new shapes there)                    issues the recorded order
    replay     one rank's whole call runs on the eager        the hooks issue the recorded order
               hooks (its recompile limit reached)            (a `WirePlan`)
    relaunch   a new launch's first graph of a frame comes    none of our passes run: the orders are
               from Inductor's caches                         read from beside the caches

Transitions.

    from       event                                                          to
    ---------  -------------------------------------------------------------  ---------------------
    agree      every rank told the same graph: it keeps the full schedule     agree
    agree      the same graph on inputs of other shapes: it alone keeps       agree
               program order (the sequences still line up)
    agree      a rank told nothing in time (it runs a graph it compiled       agree
               before): the graph keeps the full schedule
    agree      different graphs, or a group eager on one rank where another   diverged
               traced it (the rank that sees it marks the log); or the lowest
               rank finds the set marked after reading the others' entries
    diverged   any graph of several groups                                    diverged
    diverged   the process group destroyed and another initialised            agree (a fresh log)
    first      both of its orders recorded (and written beside the caches)    recorded
    recorded   Dynamo compiles the frame again on one rank                    recompile
    recompile  its graphs issue the recorded order                            recorded
    recorded   a call on one rank falls back to the eager hooks               replay, for that call
    relaunch   the orders read from beside the caches                         recorded

Graphs of one group, and graphs where nobody is there to tell (one rank, the fake process group),
ask nobody: one group's collectives cannot be reordered across groups. A backend built with
`rank_divergent_graphs=True` asks nobody either: every graph keeps program order from the start.

[Note: Ranks that compile different graphs]
Dynamo decides per rank what it traces. Python in the forward that depends on the rank, or a graph
break or recompile limit reached on one rank only, gives one rank a graph holding several groups
where another runs some of those groups on the eager hooks. The scheduling passes merge and reorder
collectives of different groups, which the eager hooks cannot match: the two ranks would put
different collectives on the wire (gloo aborts, NCCL hangs or mixes their bytes). A graph that keeps
every group's collectives on their own and in program order matches the eager hooks
([Note: Fallback groups keep the traced order] in traced/hooks.py); that is what
`rank_divergent_graphs=True` asks for, for every graph.

Without it, each rank tells the other ranks of its mesh, through the peer log (no collective: a rank
that traced less would never join one), of every graph it compiles that holds collectives,
described by its groups in program order, its number of operations and the shapes of its inputs
other than parameters, and of every group whose hooks first run eagerly in a compiled call. A graph
of several groups waits for the others' entry at the same place in that sequence and compares. The
lowest rank compares every rank's entry with its own and writes the verdict; the others compare
theirs with the lowest rank's and read the verdict. The first time the graphs differ, the set of
ranks is diverged: that graph, and every later one of several groups, keeps program order, as
`rank_divergent_graphs` does, and a warning says why. The rank that finds the difference may be the
only one to compare (the lowest rank ran those groups on the eager hooks, and told no graph to
compare), so it marks the set in the log before its next entry; every rank checks the mark before it
compares, and the lowest rank again after it read the others' entries, so a later graph cannot keep
the full schedule on one rank and program order on another. Ranks that compile the same graphs wait
only for each other's tracing; a rank that runs the groups eagerly, or traces them one by one, is
seen at once. The same graph on inputs of other shapes (each rank's own sequence length, or its own
value of a dynamic size) is scheduled with other costs, which may order its collectives
differently: such a graph alone keeps program order, and later graphs are compared again.

A graph Dynamo compiles again for a frame it compiled before asks nobody: [Note: One wire order per
frame]. A rank whose whole call first falls back to the eager hooks in a later step asks nobody
either: its hooks issue the frame's recorded order ([Note: A fallback keeps the frame's wire order]
in runtime/wire_plan.py), where that order holds single groups' collectives, merged buckets or a
bucket's pieces; a graph whose order the hooks cannot issue gives no plan, and such a program needs
`rank_divergent_graphs=True`.

[Note: One wire order per frame]
A rank recompiles a frame alone whenever its own inputs fail the guards and the others' do not
(each rank pads its batch to its own longest row: a new length on one rank, the graph going dynamic
there first). It must then issue the collectives the others' graph issues, in that order, and there
is nobody to ask: the others run their graph without compiling, so an entry in the log would wait
`AGREEMENT_TIMEOUT_S` for nothing and put the sequences out of step. Every graph of a frame has the
same groups in the same program order, and they differ in shapes only, which changes the costs the
scheduling passes weigh, and so at most the order of the collectives (the buckets are sized by
parameters, which shapes do not change). So the first graph of a frame, agreed with the other ranks
as above, records its wire order for each of its forward and backward graphs (passes/wire_order.py),
and a later graph of the same frame and groups is scheduled as usual and then issues its collectives
in the recorded order (`order_collectives_as`, which keeps the schedule where that order allows; on
gloo an all-gather writes a buffer of its own, which other collectives may pass). A later graph also
keeps the groups the first backward gathers ([Note: One collective set per frame] in
passes/unshard_selection.py). The records are kept per root context (weakly: a model gone takes its
own along) and per backend options, so another model or backend never takes them, even where Dynamo
numbers its frame as an earlier one's (after `torch._dynamo.reset()`). With Inductor the recorded
order joins the compile-cache key.

[Note: Wire orders beside the compile caches]
A frame whose first graph Inductor's caches hand back runs none of our passes, so nothing would be
recorded, and the next graph of the frame would be agreed as a first one: in a relaunch with warm
caches, a rank that recompiled alone would ask the others, who are not compiling, and then issue
program order where they run their graph's order. So a frame's first graph also keeps its recorded
orders in a small file beside those caches (`wire_orders_file` in fsdp_graph/compile/cache_key.py),
named by what the compiled graph depends on, and reads it when it compiles: a graph the caches hand
back finds the orders its cold compile recorded. The ranks that compile the same first graph record
the same orders (that is what their agreement is for), so they may share the file. A graph whose
passes run records its orders again, the same ones.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from ..passes.nodes import fsdp_meta
from ..passes.wire_order import eager_collectives, gathered_groups, order_collectives_as, wire_order
from ..runtime.meta import GROUP_KEY
from ..runtime.peer_log import PeerLog
from ..runtime.wire_plan import WirePlan
from .cache_key import wire_orders_file
from .owners import ranks_of, root_of

logger = logging.getLogger(__name__)

AGREEMENT_TIMEOUT_S = 30.0  # how long a rank waits for the others' entry for the same graph
_GRAPHS = "G"  # a verdict: the ranks compiled different graphs
_SHAPES = "S"  # a verdict: the same graph, on inputs of different shapes


def graph_groups(gm: GraphModule) -> list[str]:
    """The groups whose collectives `gm` holds, in the order they first appear."""
    groups: dict[str, None] = {}
    for node in gm.graph.nodes:
        name = fsdp_meta(node, GROUP_KEY)
        if name:
            groups[str(name)] = None
    return list(groups)


# Per root context (held weakly: a model gone takes its records along), the wire orders of its
# frames, per frame, groups, grad mode and backend options: [Note: One wire order per frame].
_frames_of_root: "weakref.WeakKeyDictionary[Any, dict[tuple, FrameWireOrder]]" = weakref.WeakKeyDictionary()


def frame_order(
    gm: GraphModule, example_inputs: Sequence, owners: list, options: str, beside_caches: bool
) -> tuple["FrameWireOrder", bool]:
    """The wire order `gm`'s graphs keep ([Note: One wire order per frame]), and whether `gm` must
    keep every group's collectives in program order (`diverged`, asked only of the first graph of a
    frame). `owners`: the graph's sharded parameters (fsdp_graph/compile/owners.py); `options`: the
    backend's options, as its cache key spells them; `beside_caches`: the graph may come from
    Inductor's caches ([Note: Wire orders beside the compile caches])."""
    root = root_of(owners[0]) if owners else None
    compile_id = torch._guards.CompileContext.current_compile_id()
    frames = _frames_of_root.setdefault(root, {}) if compile_id is not None and root is not None else None
    grad_enabled = torch.is_grad_enabled()
    key = (None if compile_id is None else compile_id.frame_id, tuple(graph_groups(gm)), grad_enabled, options)
    known = None if frames is None else frames.get(key)
    if known is not None and "forward" in known.orders:
        logger.info("fsdp_graph: graph %s recompiles a frame: its collectives keep the order of the frame's first "
                    "graph ([Note: One wire order per frame])", compile_id)
        known.recompiling = True
        return known, known.program_order
    program_order = diverged(gm, example_inputs, ranks_of(owners))
    order = FrameWireOrder(program_order)
    if frames is not None:
        frames[key] = order
        if grad_enabled and not program_order:  # a backward to keep the order of; program order needs no plan
            order.plan_for(root, key)
    if beside_caches:
        order.keep_beside_caches(wire_orders_file(gm, example_inputs, options, graph_groups(gm)))
    return order, program_order


def diverged(gm: GraphModule, example_inputs: Sequence, ranks: Sequence[int],
             timeout_s: float = AGREEMENT_TIMEOUT_S) -> bool:
    """Whether this graph must keep every group's collectives in program order; tells the other
    ranks about it either way ([Note: Ranks that compile different graphs])."""
    groups = graph_groups(gm)
    ranks = tuple(sorted(ranks))
    log = PeerLog.of_default_group()
    if not groups or log is None:
        return False
    ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    entry = f"graph:{'|'.join(groups)}#{ops}@{_input_shapes(example_inputs)}"
    index = log.tell(ranks, entry)
    if index is None or len(groups) < 2:  # one group's order needs no agreement
        return False
    if log.out_of_step(ranks):  # this rank or another saw them diverge
        if dist.get_rank() == ranks[0]:
            log.decide(ranks, index, _GRAPHS + "the ranks diverged before")
        return True
    verdict = _verdict(log, ranks, index, entry, timeout_s)
    if not verdict:
        return False
    kind, why = verdict[:1], verdict[1:]
    if kind == _GRAPHS:  # the sequences may no longer line up: never ask again
        log.mark_out_of_step(ranks)
        logger.warning(
            "fsdp_graph: the ranks compiled different graphs (%s); from here on, graphs of several groups "
            "keep each group's collectives in program order, as with fsdp_graph.backend(rank_divergent_graphs="
            "True) ([Note: Ranks that compile different graphs])", why)
    else:
        logger.info("fsdp_graph: %s; this graph keeps each group's collectives in program order "
                    "([Note: Ranks that compile different graphs])", why)
    return True


def diverged_ranks() -> frozenset[tuple[int, ...]]:
    """The sets of ranks seen to compile different graphs in the default process group's log."""
    log = PeerLog.of_default_group(begin=False)
    return frozenset() if log is None else log.marked_out_of_step()


def _verdict(log: PeerLog, ranks: tuple[int, ...], index: int, entry: str, timeout_s: float) -> str:
    """What the ranks conclude about entry `index`: "" (the same graph, or a rank silent in time),
    else a verdict's kind and why. The lowest rank compares every rank's entry with its own and
    writes the verdict; the others compare theirs with the lowest rank's and read the verdict: about
    4 store operations per rank, not one per pair of ranks."""
    leader = ranks[0]
    deadline = time.monotonic() + timeout_s  # one wait in all, however many ranks are silent
    if dist.get_rank() == leader:
        verdict = ""
        for other in ranks[1:]:
            why = _compare(log, ranks, index, other, entry, deadline) or ""
            verdict = verdict or why
            if why.startswith(_GRAPHS):
                verdict = why
                break
        if not verdict.startswith(_GRAPHS) and log.out_of_step(ranks):  # read after their entries
            verdict = _GRAPHS + "another rank saw the ranks diverge before"
        log.decide(ranks, index, verdict)
        return verdict
    verdict = _compare(log, ranks, index, leader, entry, deadline)
    if verdict is None:  # the lowest rank compiles nothing here, so it decides nothing either
        return ""
    if not verdict.startswith(_GRAPHS):
        verdict = log.read(ranks, index, "verdict", 2 * timeout_s) or ""  # the leader waits up to timeout_s
    return verdict


def _input_shapes(example_inputs: Sequence) -> str:
    """The shapes of the graph's inputs other than parameters (whose shards may differ by rank), with
    each symbolic size's value on this rank: the scheduling passes' costs depend on them."""
    shapes = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            shapes.append("x".join(str(d) if isinstance(d, int) else f"{d}={d.node.hint}" for d in t.shape))
    return ",".join(shapes)


def _compare(
    log: PeerLog, ranks: tuple[int, ...], index: int, other: int, entry: str, deadline: float
) -> Optional[str]:
    """"" if rank `other`'s entry `index` is `entry`, else a verdict (its kind, then why); None if
    that rank told nothing by `deadline` (`time.monotonic()`)."""
    theirs = log.read(ranks, index, other, max(0.0, deadline - time.monotonic()))
    if theirs is None:
        # Most likely that rank runs a graph it compiled before, where this one recompiles (its own
        # shapes): the same program, so the graph keeps the full schedule.
        logger.info("fsdp_graph: rank %d told of nothing at #%d in time; graph #%d keeps its schedule "
                    "([Note: Ranks that compile different graphs])", other, index, index)
        return None
    if theirs == entry:
        return ""
    if theirs.partition("@")[0] == entry.partition("@")[0]:
        return f"{_SHAPES}rank {other}'s graph #{index} is this rank's on inputs of other shapes"
    return f"{_GRAPHS}at #{index} rank {other} has {_describe(theirs)}, rank {dist.get_rank()} {_describe(entry)}"


def _describe(entry: str) -> str:
    kind, _, what = entry.partition(":")
    if kind == "eager":
        return f"group {what} on the eager hooks"
    groups, _, ops = what.partition("@")[0].rpartition("#")
    return f"a graph of groups {groups.replace('|', ', ')} ({ops} operations)"


class FrameWireOrder:
    """The wire order of a frame's graphs: [Note: One wire order per frame].

    Attributes:
        program_order: the frame's first graph kept every group's collectives in program order.
        orders: per kind of graph ("forward", "backward"), the wire order of its first one.
        saved_at: the file beside the compile caches the orders are kept in, if any.
    """

    def __init__(self, program_order: bool) -> None:
        self.program_order = program_order
        self.orders: dict[str, tuple[str, ...]] = {}
        self.saved_at: Optional[str] = None
        self.recompiling = False  # a later graph of the frame is being compiled, which the orders bind
        self._root: Optional[weakref.ref] = None  # the root context to hand the orders to, and its key
        self._key: Any = None

    def plan_for(self, root: Any, key: Any) -> None:
        """Hand the orders, once both are known, to `root` (a runtime RootContext) as its eager
        hooks' plan for a step on one rank that falls back: [Note: A fallback keeps the frame's
        wire order] in runtime/wire_plan.py."""
        self._root, self._key = weakref.ref(root), key
        self._offer_plan()

    def _offer_plan(self) -> None:
        root = self._root() if self._root is not None else None
        if root is None or "forward" not in self.orders or "backward" not in self.orders:
            return
        forward, backward = (eager_collectives(self.orders[kind]) for kind in ("forward", "backward"))
        if forward is None or backward is None:
            root.wire_plans.pop(self._key, None)
            logger.info("fsdp_graph: the compiled frame's graphs hold collectives the eager hooks cannot issue in "
                        "their order (a group's bucket twice, or a collective of the graph's own on a group): a rank "
                        "that falls back to them later does not keep that order ([Note: A fallback keeps the frame's "
                        "wire order])")
            return
        root.wire_plans[self._key] = WirePlan(forward, backward)

    def keep_beside_caches(self, path: str) -> None:
        """Read the orders a cold compile of the same first graph recorded at `path`, if any, and
        write there what this one records: [Note: Wire orders beside the compile caches]."""
        self.saved_at = path
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return
        if isinstance(saved, dict):
            for kind, order in saved.items():
                self.orders.setdefault(kind, tuple(order))
            self._offer_plan()

    def _save(self) -> None:
        if self.saved_at is None:
            return
        try:
            os.makedirs(os.path.dirname(self.saved_at), exist_ok=True)
            temporary = f"{self.saved_at}.{os.getpid()}"
            with open(temporary, "w") as f:
                json.dump(self.orders, f)
            os.replace(temporary, self.saved_at)  # whole, even with another rank writing the same
        except OSError as error:
            logger.warning("fsdp_graph: could not keep the wire orders in %s (%s); a relaunch that loads this graph "
                           "from the compile caches agrees its next graph with the other ranks", self.saved_at, error)

    def cache_key(self) -> str:
        """The orders a later graph of the frame keeps, for the compile caches ("" for the first
        graph, which the orders do not bind: it is what records them)."""
        return repr(sorted(self.orders.items())) if self.recompiling and self.orders else ""

    def first_backward_gathers(self) -> Optional[frozenset[str]]:
        """For a later graph of the frame, the groups whose parameters the first backward gathers,
        which fixes the groups it keeps unsharded ([Note: One collective set per frame] in
        passes/unshard_selection.py); None for the first graph, or before its backward ran."""
        recorded = self.orders.get("backward") if self.recompiling else None
        return gathered_groups(recorded) if recorded is not None else None

    def keep(self, kind: str, gm: GraphModule) -> None:
        """Record `gm`'s wire order if it is the frame's first graph of its kind, else make it
        issue its collectives in the recorded order."""
        recorded, scheduled = self.orders.get(kind), wire_order(gm)
        if recorded is None:
            self.orders[kind] = scheduled
            self._save()
            self._offer_plan()
        elif scheduled == recorded:
            return
        elif order_collectives_as(gm, recorded):
            logger.info("fsdp_graph: the %s graph's collectives, scheduled in another order (%s), issue in the order "
                        "of the frame's first graph ([Note: One wire order per frame])", kind, scheduled)
        else:
            logger.warning(
                "fsdp_graph: a %s graph compiled again for this frame issues other collectives than its first graph "
                "(%s, where the first issued %s); if another rank runs the first graph, they do not match "
                "([Note: One wire order per frame])", kind, scheduled, recorded)
