"""The predicted schedule as a Chrome trace (the JSON torch.profiler writes; Perfetto and
chrome://tracing open it): `python -m fsdp_graph.inspect DIR --trace out.json`.

Layout (trace-event format: times in microseconds, one "X" complete event per slice):
    process "predicted on <profile>"
        thread "compute"                          compute nodes, and "wait <collective>" where the
                                                  compute stream stalls (exposed communication)
        thread "collectives (<N> ranks)"          one per process-group size and parallelism ("tp
                                                  collectives (<N> ranks)" for tensor parallelism's):
                                                  the collectives issued on those groups, named
                                                  "<op> <fsdp group>" (or "<op> [tp]"), with
                                                  bytes (all ranks and per rank), the issue and wait
                                                  nodes and the exposed time as args
        counter "live memory (MiB)"               bytes the graph allocated, per rank
The graphs of one step (forward, then backward) are laid end to end. With `measured=` (a
torch.profiler trace of the same step, e.g. from an example's `--profile-dir`) the measured
processes are added beside the predicted one, renumbered, named "measured: ...", and shifted so
that both start at 0.

`eager_gathers` reads the eager runtime's schedule from a measured trace: each all-gather the
runtime issued (its `fsdp_graph::all_gather (<group>)` span) and the hook it was issued in (the
enclosing `fsdp_graph::pre_forward|pre_backward (<group>)` span): a gather issued in another group's
hook is a prefetch. Groups on the eager hooks (compile scope "block", fallbacks, eager mode) have
no graph to predict them from; this shows what they did.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from ..passes.simulator import Program, Simulation

PREDICTED_PID = 1
MEASURED_PID_BASE = 100  # measured processes get 100, 101, ... whatever their own pids were
COMPUTE_TID = 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def predicted_events(sims: dict[str, Simulation], programs: dict[str, Program]) -> list[dict[str, Any]]:
    """Trace events of the simulated graphs (in step order, see `timeline.step_order`) laid end to
    end. See the module docstring."""
    profiles = sorted({sim.profile for sim in sims.values()})
    events = [
        _metadata("process_name", PREDICTED_PID, 0, {"name": f"predicted on {', '.join(profiles)}"}),
        _metadata("process_sort_index", PREDICTED_PID, 0, {"sort_index": 0}),
        _metadata("thread_name", PREDICTED_PID, COMPUTE_TID, {"name": "compute"}),
        _metadata("thread_sort_index", PREDICTED_PID, COMPUTE_TID, {"sort_index": 0}),
    ]
    tid_of_stream: dict[tuple[str, int], int] = {}
    offset = 0.0
    for label in sims:
        sim = sims[label]
        ops = {op.name: op for op in programs[label]}
        for name, start, end in sim.compute_spans:
            events.append({"name": ops[name].target, "cat": "compute", "ph": "X", "ts": _us(offset + start),
                           "dur": _us(end - start), "pid": PREDICTED_PID, "tid": COMPUTE_TID,
                           "args": {"node": name, "graph": label}})
        for c in sim.collectives:
            op = ops[c.name]
            world = max(op.facts.world, 1)
            stream = (c.parallelism, world)
            if stream not in tid_of_stream:
                tid = tid_of_stream[stream] = COMPUTE_TID + 1 + len(tid_of_stream)
                whose = "" if c.parallelism == "fsdp" else f"{c.parallelism} "
                events.append(_metadata("thread_name", PREDICTED_PID, tid, {"name": f"{whose}collectives ({world} ranks)"}))
                events.append(_metadata("thread_sort_index", PREDICTED_PID, tid, {"sort_index": tid}))
            wait = programs[label][c.wait_index].name if c.wait_index >= 0 else None
            args = {
                "group": c.group, "graph": label, "bytes (all ranks)": c.num_bytes,
                "bytes (per rank)": c.num_bytes if c.kind == "all_reduce" else c.num_bytes // world,
                "issue node": c.name, "wait node": wait, "prefetch distance (compute nodes)": c.prefetch_distance,
                "exposed (ms)": round(c.exposed_s * 1e3, 6),
            }
            events.append({"name": f"{c.kind} {c.group or '?'}", "cat": "collective", "ph": "X",
                           "ts": _us(offset + c.start_s), "dur": _us(c.end_s - c.start_s),
                           "pid": PREDICTED_PID, "tid": tid_of_stream[stream], "args": args})
            if c.exposed_s > 0:
                events.append({"name": f"wait {c.kind} {c.group or '?'}", "cat": "exposed communication", "ph": "X",
                               "ts": _us(offset + c.end_s - c.exposed_s), "dur": _us(c.exposed_s),
                               "pid": PREDICTED_PID, "tid": COMPUTE_TID, "args": {"wait node": wait, "graph": label}})
        for t, live in sim.memory_points:
            events.append({"name": "live memory (MiB, per rank)", "ph": "C", "ts": _us(offset + t),
                           "pid": PREDICTED_PID, "tid": 0, "args": {"MiB": round(live / 2**20, 3)}})
        offset += sim.total_s
    return events


def measured_events(trace: dict[str, Any] | list) -> list[dict[str, Any]]:
    """The events of a torch.profiler Chrome trace, renumbered to pids from `MEASURED_PID_BASE`,
    processes renamed "measured: <name>", and shifted so that the earliest event starts at 0."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    timed = [float(e["ts"]) for e in events if e.get("ph") != "M" and "ts" in e]
    start = min(timed, default=0.0)
    pids: dict[Any, int] = {}
    out = []
    for event in events:
        if "pid" not in event or "ph" not in event:
            continue
        event = dict(event)
        pid = pids.setdefault(event["pid"], MEASURED_PID_BASE + len(pids))
        event["pid"] = pid
        event.setdefault("tid", 0)
        event.setdefault("name", "")
        if event["ph"] == "M":
            event["ts"] = 0
            if event["name"] == "process_name":
                event["args"] = {"name": f"measured: {event.get('args', {}).get('name', pid)}"}
        elif "ts" in event:
            event["ts"] = round(float(event["ts"]) - start, 3)
        out.append(event)
    for original, pid in pids.items():
        if not any(e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == pid for e in out):
            out.append(_metadata("process_name", pid, 0, {"name": f"measured: process {original}"}))
        out.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
    return out


def write_trace(path: str | os.PathLike, sims: dict[str, Simulation], programs: dict[str, Program],
                measured: Optional[dict[str, Any] | list] = None) -> Path:
    """Write the predicted schedule (and a measured torch.profiler trace, as `read_trace` loads it,
    beside it) to `path`."""
    events = predicted_events(sims, programs)
    if measured is not None:
        events += measured_events(measured)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


_HOOK_SPAN = re.compile(r"fsdp_graph::(pre_forward|pre_backward) \((.+)\)$")
_GATHER_SPAN = re.compile(r"fsdp_graph::all_gather \((.+)\)$")


def read_trace(path: str | os.PathLike) -> dict[str, Any] | list:
    """A torch.profiler Chrome trace; ValueError naming how to write one if it is not."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--measured {path}: not a readable Chrome trace JSON ({error}); write one with "
                         f"torch.profiler's export_chrome_trace or an example's --profile-dir") from error


def eager_gathers(trace: dict[str, Any] | list) -> list[tuple[str, str, str]]:
    """The eager runtime's all-gathers in a measured trace, in issue order, per thread: (phase
    "forward"/"backward", the group gathered, the group whose hook issued it)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    hooks = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("pid"), e.get("tid"), m.group(1), m.group(2))
             for e in spans if (m := _HOOK_SPAN.match(e.get("name", "")))]
    gathers = []
    for event in sorted(spans, key=lambda e: float(e["ts"])):
        match = _GATHER_SPAN.match(event.get("name", ""))
        if match is None:
            continue
        at = float(event["ts"])
        around = [h for h in hooks if h[0] <= at <= h[1] and h[2:4] == (event.get("pid"), event.get("tid"))]
        if around:
            hook = max(around, key=lambda h: h[0])  # the innermost
            gathers.append(("forward" if hook[4] == "pre_forward" else "backward", match.group(1), hook[5]))
    return gathers


def format_eager_gathers(gathers: list[tuple[str, str, str]]) -> str:
    """The table `python -m fsdp_graph.inspect DIR --measured TRACE` prints."""
    if not gathers:
        return "eager runtime's all-gathers (measured): none (every group's collectives ran in a graph)"
    width = max(len(group) for _, group, _ in gathers)
    lines = ["eager runtime's all-gathers (measured), in issue order:"]
    for phase, group, hook in gathers:
        mark = "   prefetched" if group != hook else ""
        lines.append(f"  {phase:8}  {group:{width}}  issued in pre_{phase} ({hook}){mark}")
    prefetched = sum(group != hook for _, group, hook in gathers)
    lines.append(f"  prefetched (issued in another group's hook): {prefetched} of {len(gathers)}")
    return "\n".join(lines)
