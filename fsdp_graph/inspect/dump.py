"""Graph dumps: every graph the backend sees, before and after each pass, and a summary.

A dump directory holds:
    <graph>.dynamo.txt                     the graph Dynamo captured
    <graph>.joint.<pass>.{before,after}.txt the joint graph around each joint pass
    <graph>.{forward,backward}.txt         the partitioned graphs the inner compiler gets
    <graph>.{forward,backward}.<stage>.<pass>.{before,after}.txt
                                           each of those around each pass of the stage
                                           ("schedule", "lower"; passes/table.py)
    summary.json                           per graph: collectives in order, with group and bytes, and
                                           the seconds each pass took; per root: modules that fell
                                           back to the eager hooks, and why

`<graph>` is Dynamo's compile id (`frame_<frame>_<recompile>`), the same as in `TORCH_LOGS`.
`python -m fsdp_graph.inspect DIR` prints the summary (`format_summary`).

Under `TORCH_TRACE=dir` the same graphs go into torch's structured trace as artifacts, so that
`tlparse` lists them beside Dynamo's and Inductor's under the graph's compile id:
`fsdp_graph_<label>` (a graph as text, label as the file name above without `.txt`),
`fsdp_graph_summary` (one graph's summary entry, JSON), `fsdp_graph_pass` (one pass's seconds, JSON)
and `fsdp_graph_fallbacks` (JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch._logging import trace_structured
from torch.fx import GraphModule

from ..passes.checkpoint_policy import recomputed_by_policy
from ..passes.cost_model import op_facts
from ..passes.table import PASS_NAMES
from ..passes.nodes import (
    KEPT_UNSHARDED_META, chunk_of, collective_label, gathered_from, group_of, is_collective, is_wait_tensor, parallelism_of,
    tensor_bytes,
)

SUMMARY_FILE = "summary.json"


def collectives(gm: GraphModule) -> list[dict[str, Any]]:
    """The collectives of `gm` in graph order: node index and name, op, group, dtype, bytes of the output and
    of the input, and the slice of `run_in_chunks` that made it, if one did. One rank's output and input: an all-gather's input is this rank's shard and its
    output the bucket of all ranks; a reduce-scatter the other way round."""
    found = []
    for index, node in enumerate(gm.graph.nodes):
        if is_collective(node):
            found.append(
                {
                    "index": index,
                    "name": node.name,
                    "op": node.target.__name__.split(".")[0],
                    "group": collective_label(node),
                    "by": parallelism_of(node),
                    "dtype": _dtype_name(node),
                    "bytes": tensor_bytes(node),
                    "input_bytes": tensor_bytes(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else 0,
                    "world": op_facts(node).world,
                }
            )
            chunk = chunk_of(node)
            if chunk is not None:  # made by a slice of `run_in_chunks`
                found[-1]["chunk"] = chunk
    return found


def _dtype_name(node: torch.fx.Node) -> str:
    """The dtype of `node`'s tensor value without the `torch.` prefix ("uint8"), or "?"."""
    val = node.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"


def saved_unsharded(gm: GraphModule) -> list[dict[str, str]]:
    """Outputs of a forward graph that are (views of) all-gathered parameters: what the forward
    keeps unsharded for backward. Empty when every group reshards after forward."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found = []
    for value in output.all_input_nodes:
        gathered = gathered_from(value)
        if gathered is not None:
            found.append({"node": value.name, "group": group_of(gathered) or "?"})
    return found


def kept_by_budget(gm: GraphModule) -> dict[str, int]:
    """Groups that passes/unshard_selection.py keeps unsharded until backward, with their unsharded
    bytes: the memory each costs, and the all-gather bytes per step each saves."""
    return {group_of(n) or "?": n.meta[KEPT_UNSHARDED_META] for n in gm.graph.nodes if KEPT_UNSHARDED_META in n.meta}


def _short_target(node) -> str:
    name = str(node.target) if node.op == "call_function" else f"{node.op}:{node.target}"
    return name.removesuffix(".default")


def _format_arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return str(arg).removeprefix("torch.")
    return repr(arg)


def _format_value(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (int, torch.SymInt)):
        return "int"
    return ""


def format_graph(gm: GraphModule) -> str:
    """One line per node: `name = op(args) : dtype[shape]`, collectives marked with their group and
    nodes a pass tagged for recompute marked `recompute`. Compact enough to diff and to test."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name}: {_format_value(node)}")
            continue
        if node.op == "output":
            lines.append(f"return {_format_arg(node.args[0])}")
            continue
        args = [_format_arg(a) for a in node.args] + [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
        line = f"{node.name} = {_short_target(node)}({', '.join(args)}) : {_format_value(node)}"
        notes = []
        if is_collective(node):
            notes.append(collective_label(node))
        if "recompute" in node.meta and "ac_graph_id" in node.meta:
            notes.append("recompute")
        if notes:
            line += "  # " + " ".join(notes)
        lines.append(line)
    return "\n".join(lines) + "\n"


def count_ops(gm: GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if is_collective(node) or is_wait_tensor(node):
            name = node.target.__name__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _artifact(name: str, encoding: str, payload_fn, compile_id=None) -> None:
    """One structured-trace artifact; `payload_fn` runs only when a trace is being written."""
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn,
                     compile_id=compile_id)


class GraphDump:
    """Writes graphs and the summary into one directory (created on first write), and as
    structured-trace artifacts when `structured_trace` (TORCH_TRACE is set)."""

    def __init__(self, directory: Optional[str | os.PathLike], structured_trace: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.structured_trace = structured_trace
        # Fallbacks are recorded after the compile, when torch no longer knows which graph runs.
        self._compile_id = torch._guards.CompileContext.current_compile_id()

    def _path(self, name: str) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory / name

    def write_graph(self, gm: GraphModule, label: str) -> None:
        if self.directory is not None:
            self._path(f"{label}.txt").write_text(format_graph(gm))
        if self.structured_trace:
            _artifact(f"fsdp_graph_{label}", "string", lambda: format_graph(gm))

    def _update_summary(self, update) -> None:
        if self.directory is None:
            return
        path = self._path(SUMMARY_FILE)
        summary = json.loads(path.read_text()) if path.exists() else {"graphs": {}, "fallbacks": {}}
        update(summary)
        # Every rank of a torchrun job dumps into the same directory (the graphs are the same): each
        # writes its own temporary file, so that one rank's rename never finds the other's gone.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary, indent=1, sort_keys=True))
        tmp.replace(path)

    def record_graph(self, graph_id: str, kind: str, gm: GraphModule) -> None:
        """Add `gm`'s collectives to the summary under `graph_id` / `kind` (forward, backward...)."""
        entry = {"collectives": collectives(gm), "num_nodes": len(gm.graph.nodes)}
        if kind == "forward":
            entry["saved_unsharded"] = saved_unsharded(gm)
            entry["kept_by_budget"] = kept_by_budget(gm)
        elif kind == "backward":
            entry["recomputed_by_policy"] = recomputed_by_policy(gm)
        self._update_summary(lambda s: s["graphs"].setdefault(graph_id, {}).__setitem__(kind, entry))
        if self.structured_trace:
            _artifact("fsdp_graph_summary", "json", lambda: json.dumps({"graphs": {graph_id: {kind: entry}}}))

    def record_pass(self, graph_id: str, stage: str, name: str, seconds: Optional[float]) -> None:
        """Keep the seconds pass `name` took at `stage` on graph `graph_id` ("frame_0_0" for the
        joint graph, "frame_0_0.forward" for a partitioned one); None: it was disabled."""
        self._update_summary(lambda s: s.setdefault("passes", {}).setdefault(graph_id, {})
                             .setdefault(stage, {}).__setitem__(name, seconds))
        if self.structured_trace:
            entry = {"graph": graph_id, "stage": stage, "pass": name, "seconds": seconds}
            _artifact("fsdp_graph_pass", "json", lambda: json.dumps(entry))

    def record_fallbacks(self, fallbacks: dict[str, str]) -> None:
        self._update_summary(lambda s: s["fallbacks"].update(fallbacks))
        if self.structured_trace:
            _artifact("fsdp_graph_fallbacks", "json", lambda: json.dumps({"fallbacks": fallbacks}), self._compile_id)


def load_summary(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / SUMMARY_FILE
    if not path.exists():
        raise ValueError(
            f"{directory} has no {SUMMARY_FILE}; dump graphs first with FSDP_GRAPH_DUMP={directory} or "
            f"torch.compile(model, backend=fsdp_graph.backend(dump_dir={str(directory)!r}))"
        )
    summary = json.loads(path.read_text())
    for graphs in summary["graphs"].values():
        if any("input_bytes" not in c for entry in graphs.values() for c in entry["collectives"]):
            raise ValueError(f"{path} was written by an older fsdp_graph (no input bytes per collective); dump again")
    return summary


def format_bytes(num: int) -> str:
    if num < 0:
        return "? B (symbolic size)"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def _rank_and_bucket_bytes(collective: dict[str, Any]) -> tuple[int, int]:
    """(bytes one rank sends or keeps, bytes of the whole bucket over all ranks): the smaller and the
    larger of a collective's input and output (equal for an all-reduce); for an all-to-all, what this
    rank sends, and that times the ranks (each sends its own share, which only the data sizes)."""
    if collective["op"] == "all_to_all_single" and "world" in collective:
        sent = collective["input_bytes"]
        return (-1, -1) if sent < 0 else (sent, sent * collective["world"])
    sizes = (collective["bytes"], collective["input_bytes"])
    return (-1, -1) if min(sizes) < 0 else (min(sizes), max(sizes))


def _sum_bytes(sizes) -> int:
    return -1 if min(sizes) < 0 else sum(sizes)


def format_summary(summary: dict[str, Any]) -> str:
    """Per graph: collectives in order with their group, whose they are ("fsdp", or e.g. "tp" for
    tensor parallelism's, whose group shows as "[tp]") and bytes (per rank: the shard one rank sends
    or receives; all ranks: the unsharded bucket), totals per group; then fallbacks."""
    lines = []
    for graph_id in sorted(summary["graphs"]):
        for kind, entry in sorted(summary["graphs"][graph_id].items(), key=lambda item: item[0] != "forward"):
            found = entry["collectives"]
            lines.append(f"{graph_id} {kind}: {len(found)} collectives, {entry['num_nodes']} nodes")
            lines.append(f"  {'node':<6} {'op':<24} {'group':<20} {'by':<5} {'per rank':>12} {'all ranks':>12}")
            per_group: dict[tuple[str, str], list[tuple[int, int]]] = {}
            for c in found:
                sizes = _rank_and_bucket_bytes(c)
                lines.append(f"  #{c['index']:<5} {c['op']:<24} {c['group']:<20} {c.get('by', 'fsdp'):<5} "
                             f"{format_bytes(sizes[0]):>12} {format_bytes(sizes[1]):>12}")
                per_group.setdefault((c["group"], c["op"]), []).append(sizes)
            for (group, op), sizes in sorted(per_group.items()):
                per_rank, all_ranks = (_sum_bytes(column) for column in zip(*sizes))
                lines.append(f"  total {op:<24} {group:<20} x{len(sizes):<4} "
                             f"{format_bytes(per_rank):>12} {format_bytes(all_ranks):>12}")
            if "saved_unsharded" in entry:
                saved = ", ".join(f"{s['node']} ({s['group']})" for s in entry["saved_unsharded"]) or "none"
                lines.append(f"  unsharded parameters saved for backward: {saved}")
            for group, num_bytes in sorted(entry.get("kept_by_budget", {}).items()):
                lines.append(f"  kept unsharded by memory_budget_bytes: {group}: costs {format_bytes(num_bytes)} "
                             f"until backward, saves its {format_bytes(num_bytes)} backward all-gather")
            if entry.get("recomputed_by_policy"):
                lines.append(f"  recomputed in backward by activation_checkpointing: {entry['recomputed_by_policy']} ops")
    lines += format_pass_seconds(summary.get("passes", {}))
    fallbacks = summary.get("fallbacks", {})
    if fallbacks:
        lines.append(f"fell back to the eager hooks: {len(fallbacks)} module(s)")
        for name, reason in sorted(fallbacks.items()):
            lines.append(f"  {name}: {reason}")
    else:
        lines.append("fell back to the eager hooks: none")
    return "\n".join(lines)


def format_pass_seconds(passes: dict[str, dict[str, dict[str, Optional[float]]]]) -> list[str]:
    """Per graph, the seconds each pass took (summary.json's "passes"), one row per pass in the
    table's order (passes/table.py) and one column per graph it ran on: the joint graph, then the
    forward and the backward; "off" where it was disabled."""
    columns_of: dict[str, dict[str, dict[str, Optional[float]]]] = {}
    for label, stages in passes.items():
        graph_id, _, kind = label.partition(".")
        column = columns_of.setdefault(graph_id, {}).setdefault(kind or "joint", {})
        for seconds_by_pass in stages.values():
            column.update(seconds_by_pass)
    lines = []
    for graph_id in sorted(columns_of):
        columns = columns_of[graph_id]
        kinds = sorted(columns, key=lambda kind: ("joint", "forward", "backward").index(kind)
                       if kind in ("joint", "forward", "backward") else 3)
        names = [n for n in PASS_NAMES if any(n in columns[k] for k in kinds)]
        names += sorted({n for k in kinds for n in columns[k]} - set(names))  # from another fsdp_graph version
        lines.append(f"{graph_id + ' seconds per pass':<34}" + "".join(f"{kind:>10}" for kind in kinds))
        for name in names:
            cells = [columns[k].get(name, "") for k in kinds]
            lines.append(f"  {name:<32}" + "".join(f"{_seconds(c):>10}" for c in cells))
        totals = [sum(v for v in columns[k].values() if v is not None) for k in kinds]
        lines.append(f"  {'all passes':<32}" + "".join(f"{t:>10.3f}" for t in totals))
    return lines


def _seconds(cell) -> str:
    if cell == "":
        return ""
    return "off" if cell is None else f"{cell:.3f}"
