"""Schedules in dumps, replayed on a hardware profile: a text table and an SVG timeline.

The backend writes `<graph>.<forward|backward>.program.json` (the scheduled graph as a `Program`,
see passes/simulator.py) into the dump directory. `python -m fsdp_graph.inspect DIR --profile
h100-nvlink --timeline out.svg` simulates each one on that profile and shows per graph:
the buckets (groups, bytes), where each collective is issued and waited on, its prefetch distance
(compute nodes between the two), the predicted exposed communication and the predicted peak memory.
"""

from __future__ import annotations

import copy
import html
import json
import math
import os
from pathlib import Path
from typing import Optional

from torch.fx import GraphModule

from ..passes.cost_model import CostModel
from ..passes.nodes import inline_regions, is_region_call
from .dump import format_bytes
from ..passes.simulator import CollectiveSpan, Op, Program, Simulation, in_flight, program_of, simulate

PROGRAM_SUFFIX = ".program.json"


def write_program(directory: str | os.PathLike, label: str, gm: GraphModule) -> None:
    """Write `gm` as a program to `<directory>/<label>.program.json`: each compile region's call as
    its body's ops in its place, the ops the step runs (`inline_regions`). `gm` is not changed."""
    if any(is_region_call(node) for node in gm.graph.nodes):
        gm = inline_regions(copy.deepcopy(gm))
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{label}{PROGRAM_SUFFIX}").write_text(json.dumps([op.to_json() for op in program_of(gm)]))


def step_order(label: str) -> tuple[str, bool, str]:
    """Sort key of graph labels (`frame_0_0.forward`) in the order a step runs them: per graph id,
    the forward first."""
    graph_id, _, kind = label.rpartition(".")
    return graph_id, kind != "forward", kind


def load_programs(directory: str | os.PathLike) -> dict[str, Program]:
    """Every program in a dump, by label (`frame_0_0.forward`), in `step_order`."""
    found = {}
    for path in Path(directory).glob(f"*{PROGRAM_SUFFIX}"):
        label = path.name.removesuffix(PROGRAM_SUFFIX)
        found[label] = [Op.from_json(d) for d in json.loads(path.read_text())]
    return {label: found[label] for label in sorted(found, key=step_order)}


def per_rank_bytes(span: CollectiveSpan, program: Program) -> int:
    """Bytes one rank sends or keeps of a collective: its shard of the bucket (all of it for an
    all-reduce). `span.num_bytes` is the bucket over all ranks."""
    world = max(next(op for op in program if op.name == span.name).facts.world, 1)
    return span.num_bytes if span.kind == "all_reduce" else span.num_bytes // world


def _mib(num: int) -> str:
    return f"{num / 2**20:.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def format_schedule(label: str, sim: Simulation, program: Program) -> str:
    """One graph's schedule as text. Bytes as in the summary table: per rank (the shard one rank
    sends or keeps) and all ranks (the bucket); memory is per rank."""
    lines = [
        f"{label} on {sim.profile}: step {_ms(sim.total_s)}, compute {_ms(sim.compute_s)}, "
        f"comm {_ms(sim.comm_s)}, exposed comm {_ms(sim.exposed_comm_s)} ({100 * sim.exposed_fraction:.1f}%), "
        f"peak memory {_mib(sim.memory.peak_bytes)} per rank (at {sim.memory.peak_at})",
        f"  max collectives in flight: {in_flight(program)[1]}",
        f"  {'collective':<32} {'groups (bucket)':<36} {'per rank':>12} {'all ranks':>12} {'issue':>6} {'wait':>6} "
        f"{'prefetch':>8} {'exposed':>11}",
    ]
    for c in sim.collectives:
        lines.append(
            f"  {c.name:<32} {(c.group or '?'):<36} {format_bytes(per_rank_bytes(c, program)):>12} "
            f"{format_bytes(c.num_bytes):>12} {c.issue_index:>6} {c.wait_index:>6} {c.prefetch_distance:>8} "
            f"{_ms(c.exposed_s):>11}"
        )
    return "\n".join(lines)


def simulate_dump(directory: str | os.PathLike, profile: str) -> tuple[dict[str, Program], dict[str, Simulation]]:
    """The dump's programs and their simulations on `profile`, both by label in `step_order`."""
    cost_model = CostModel(profile)
    programs = load_programs(directory)
    return programs, {label: simulate(program, cost_model) for label, program in programs.items()}


def format_schedules(programs: dict[str, Program], sims: dict[str, Simulation]) -> str:
    if not sims:
        return "no scheduled graphs in this dump (programs are written by the scheduling passes)"
    total = sum(s.total_s for s in sims.values())
    exposed = sum(s.exposed_comm_s for s in sims.values())
    peak = max(s.memory.peak_bytes for s in sims.values())
    parts = [format_schedule(label, sim, programs[label]) for label, sim in sims.items()]
    parts.append(
        f"all graphs: step {_ms(total)}, exposed comm {_ms(exposed)} ({100 * exposed / total if total else 0:.1f}%), "
        f"peak memory {_mib(peak)} per rank above the step's start (a backward counts the activations saved for it)"
    )
    return "\n".join(parts)


# -- SVG ---------------------------------------------------------------------------------------------

_COLORS = {"compute": "#7fb77e", "stall": "#d83b3b", "all_gather": "#3b7dd8", "reduce_scatter": "#d8843b",
           "all_reduce": "#8a4bd8", "all_to_all": "#c2a300", "memory": "#555555"}
_LEGEND = (("compute", "compute"), ("stall", "compute stalled at a wait (exposed communication)"),
           ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"), ("all_reduce", "all-reduce"),
           ("all_to_all", "all-to-all"), ("memory", "live memory per rank"))
_FONT = 11  # px; monospace glyphs are about 0.6 em wide, which is how labels are fitted to boxes
_CHAR_W = 0.6 * _FONT
_LANE = 20  # height of the compute and collectives lanes
_MEMORY_H = 56
_AXIS_H = 24
_LABEL_W = 130  # left margin for lane names and the memory scale: no lane text overlaps a plot
_PAD = 10


def _nice_step(span: float, max_ticks: int) -> float:
    """The smallest 1/2/5 x 10^k step that splits `span` into at most `max_ticks` intervals."""
    raw = span / max(max_ticks, 1)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _memory_unit(num: float) -> tuple[str, int]:
    return ("GiB", 2**30) if num >= 2**30 else ("MiB", 2**20) if num >= 2**20 else ("KiB", 2**10)


def _fit(text: str, width: float) -> str:
    """`text` if it fits `width` px, else its end (`layers.12` -> `~s.12`: the end tells groups
    apart) behind a "~"; "" below 3 characters."""
    fits = int(width // _CHAR_W)
    if len(text) <= fits:
        return text
    return "~" + text[len(text) - fits + 1:] if fits >= 3 else ""


def _text(x: float, y: float, text: str, anchor: str = "start", **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{html.escape(text)}</text>'


def _rect(x: float, y: float, w: float, h: float, color: str, title: str) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h}" fill="{color}">'
            f"<title>{html.escape(title)}</title></rect>")


def _legend(width: int) -> tuple[list[str], float]:
    parts, x, y = [], _PAD, _PAD
    for key, text in _LEGEND:
        item_w = 18 + len(text) * _CHAR_W + 16
        if x + item_w > width - _PAD and x > _PAD:
            x, y = _PAD, y + 18
        if key == "memory":
            parts.append(f'<line x1="{x:.1f}" y1="{y + 7}" x2="{x + 12:.1f}" y2="{y + 7}" stroke="{_COLORS[key]}" stroke-width="2"/>')
        else:
            parts.append(f'<rect x="{x:.1f}" y="{y + 1}" width="12" height="12" fill="{_COLORS[key]}"/>')
        parts.append(_text(x + 18, y + 11, text))
        x += item_w
    return parts, y + 18 + _PAD


def _graph_svg(label: str, sim: Simulation, y: float, width: int) -> tuple[list[str], float]:
    """One graph: title, compute lane, a collectives lane per parallelism, memory lane with its
    scale, time axis."""
    x0, plot_w = _PAD + _LABEL_W, width - _LABEL_W - 2 * _PAD
    scale = plot_w / max(sim.total_s, 1e-12)
    parts = [_text(_PAD, y + 13, f"{label} on {sim.profile}: step {_ms(sim.total_s)}, exposed communication "
                   f"{_ms(sim.exposed_comm_s)} ({100 * sim.exposed_fraction:.1f}%), peak memory "
                   f"{format_bytes(sim.memory.peak_bytes)} per rank", font_weight="bold")]
    y += 20
    parts.append(_text(_PAD, y + 14, "compute"))
    for name, start, end in sim.compute_spans:
        if end > start:
            parts.append(_rect(x0 + start * scale, y + 1, (end - start) * scale, _LANE - 2, _COLORS["compute"], name))
    for c in sim.collectives:
        if c.exposed_s > 0:
            parts.append(_rect(x0 + (c.end_s - c.exposed_s) * scale, y + 1, c.exposed_s * scale, _LANE - 2,
                               _COLORS["stall"], f"wait {c.name} ({c.group}): {_ms(c.exposed_s)} exposed"))
    y += _LANE
    # One lane per parallelism (FSDP's, then e.g. tensor parallelism's): each has its own stream,
    # so their collectives overlap in time and would overlap in one lane.
    lanes = sorted({c.parallelism for c in sim.collectives}, key=lambda p: (p != "fsdp", p)) or ["fsdp"]
    for parallelism in lanes:
        parts.append(_text(_PAD, y + 14, "collectives" if lanes == ["fsdp"] else f"{parallelism} collectives"))
        for c in sim.collectives:
            if c.parallelism != parallelism:
                continue
            x, w = x0 + c.start_s * scale, (c.end_s - c.start_s) * scale
            parts.append(_rect(x, y + 1, w, _LANE - 2, _COLORS[c.kind],
                               f"{c.name} ({c.group}): {c.num_bytes} bytes (all ranks), {_ms(c.end_s - c.start_s)}"))
            shown = _fit(c.group or "", w - 4)
            if shown:
                parts.append(_text(x + 2, y + 14, shown, font_size=str(_FONT - 1), fill="white"))
        y += _LANE
    y += 4
    parts += _memory_lane(sim, x0, y, scale)
    y += _MEMORY_H
    parts += _time_axis(sim.total_s, x0, y, plot_w, scale)
    return parts, y + _AXIS_H + _PAD


def _memory_lane(sim: Simulation, x0: float, y: float, scale: float) -> list[str]:
    """Live bytes as a step curve, with a scale (0 to a round number above the peak) in the margin."""
    peak = max(sim.memory.peak_bytes, 1)
    unit, size = _memory_unit(peak)
    step = _nice_step(peak / size, 3)
    top = math.ceil(peak / size / step) * step * size
    base = y + _MEMORY_H - 6
    height = _MEMORY_H - 12
    parts = [_text(_PAD, y + 12, "memory"), _text(_PAD, y + 25, "(per rank)", font_size=str(_FONT - 2))]
    axis_x = x0 - 2
    parts.append(f'<line x1="{axis_x}" y1="{base - height}" x2="{axis_x}" y2="{base}" stroke="#999"/>')
    tick = 0.0
    while tick * size <= top + 1:
        ty = base - height * tick * size / top
        parts.append(f'<line x1="{axis_x - 4}" y1="{ty:.1f}" x2="{axis_x}" y2="{ty:.1f}" stroke="#999"/>')
        parts.append(_text(axis_x - 6, ty + 4, f"{tick:g} {unit}", anchor="end", font_size=str(_FONT - 1)))
        tick += step
    points, last = [], base
    for t, live in sim.memory_points:
        ly = base - height * live / top
        points.append(f"{x0 + t * scale:.1f},{last:.1f} {x0 + t * scale:.1f},{ly:.1f}")
        last = ly
    parts.append(f'<polyline fill="none" stroke="{_COLORS["memory"]}" stroke-width="1.5" points="{" ".join(points)}">'
                 f"<title>live memory per rank, peak {_mib(peak)} at {sim.memory.peak_at}</title></polyline>")
    return parts


def _time_axis(total_s: float, x0: float, y: float, plot_w: float, scale: float) -> list[str]:
    """Ticks at round milliseconds, spaced so that their labels never touch."""
    total_ms = max(total_s * 1e3, 1e-9)
    max_ticks = max(1, int(plot_w // (12 * _CHAR_W)))
    step = _nice_step(total_ms, max_ticks)
    parts = [f'<line x1="{x0}" y1="{y}" x2="{x0 + plot_w:.1f}" y2="{y}" stroke="#999"/>', _text(_PAD, y + 16, "time (ms)")]
    tick = 0.0
    while tick <= total_ms + 1e-9:
        tx = x0 + tick / 1e3 * scale
        parts.append(f'<line x1="{tx:.1f}" y1="{y}" x2="{tx:.1f}" y2="{y + 4}" stroke="#999"/>')
        parts.append(_text(tx, y + 16, f"{round(tick, 6):g}", anchor="middle", font_size=str(_FONT - 1)))
        tick += step
    return parts


def timeline_svg(sims: dict[str, Simulation], width: int = 1600) -> str:
    """A legend, then per graph: compute (green; red where it stalls at a wait), the collectives of
    each parallelism in a lane of their own (coloured by op, labelled with their group where the
    label fits its box), live memory per rank with its scale, and a time axis in milliseconds. Lane names and scales sit in a left margin of
    their own, so no text overlaps at any graph size."""
    parts, y = _legend(width)
    for label, sim in sims.items():
        graph, y = _graph_svg(label, sim, y, width)
        parts += graph
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y:.0f}" '
            f'font-family="monospace" font-size="{_FONT}"><rect width="100%" height="100%" fill="white"/>'
            + "".join(parts) + "</svg>\n")


def write_timeline(path: str | os.PathLike, sims: dict[str, Simulation]) -> Optional[Path]:
    path = Path(path)
    text = timeline_svg(sims)
    if path.suffix == ".html":
        text = f"<!doctype html><html><body>{text}</body></html>\n"
    path.write_text(text)
    return path
