"""Schedules in dumps, replayed on a hardware profile: a text table and an SVG timeline.

The backend writes `<graph>.<forward|backward>.program.json` (the scheduled graph as a `Program`,
see passes/simulator.py) into the dump directory. `python -m fsdp_graph.inspect DIR --profile
h100-nvlink --timeline out.svg` simulates each one on that profile and shows per graph:
the buckets (groups, bytes), where each collective is issued and waited on, its prefetch distance
(compute nodes between the two), the predicted exposed communication and the predicted peak memory.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Optional

from torch.fx import GraphModule

from .passes.cost_model import CostModel
from .passes.simulator import Op, Program, Simulation, program_of, simulate

PROGRAM_SUFFIX = ".program.json"


def write_program(directory: str | os.PathLike, label: str, gm: GraphModule) -> None:
    """Write `gm` as a program to `<directory>/<label>.program.json`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{label}{PROGRAM_SUFFIX}").write_text(json.dumps([op.to_json() for op in program_of(gm)]))


def load_programs(directory: str | os.PathLike) -> dict[str, Program]:
    """Every program in a dump, by label (`frame_0_0.forward`), in label order."""
    found = {}
    for path in sorted(Path(directory).glob(f"*{PROGRAM_SUFFIX}")):
        label = path.name.removesuffix(PROGRAM_SUFFIX)
        found[label] = [Op.from_json(d) for d in json.loads(path.read_text())]
    return found


def _mib(num: int) -> str:
    return f"{num / 2**20:.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def format_schedule(label: str, sim: Simulation) -> str:
    """One graph's schedule as text."""
    lines = [
        f"{label} on {sim.profile}: step {_ms(sim.total_s)}, compute {_ms(sim.compute_s)}, "
        f"comm {_ms(sim.comm_s)}, exposed comm {_ms(sim.exposed_comm_s)} ({100 * sim.exposed_fraction:.1f}%), "
        f"peak memory {_mib(sim.memory.peak_bytes)} (at {sim.memory.peak_at})",
        f"  {'collective':<32} {'groups (bucket)':<36} {'bytes':>12} {'issue':>6} {'wait':>6} {'prefetch':>8} {'exposed':>11}",
    ]
    for c in sim.collectives:
        lines.append(
            f"  {c.name:<32} {(c.group or '?'):<36} {c.num_bytes:>12} {c.issue_index:>6} {c.wait_index:>6} "
            f"{c.prefetch_distance:>8} {_ms(c.exposed_s):>11}"
        )
    return "\n".join(lines)


def simulate_dump(directory: str | os.PathLike, profile: str) -> dict[str, Simulation]:
    cost_model = CostModel(profile)
    return {label: simulate(program, cost_model) for label, program in load_programs(directory).items()}


def format_schedules(sims: dict[str, Simulation]) -> str:
    if not sims:
        return "no scheduled graphs in this dump (programs are written by the scheduling passes)"
    total = sum(s.total_s for s in sims.values())
    exposed = sum(s.exposed_comm_s for s in sims.values())
    peak = max(s.memory.peak_bytes for s in sims.values())
    parts = [format_schedule(label, sim) for label, sim in sims.items()]
    parts.append(
        f"all graphs: step {_ms(total)}, exposed comm {_ms(exposed)} ({100 * exposed / total if total else 0:.1f}%), "
        f"peak memory of one graph {_mib(peak)}"
    )
    return "\n".join(parts)


# -- SVG ---------------------------------------------------------------------------------------------

_ROW = 22
_LANES = ("compute", "comm", "memory")
_COLORS = {"all_gather": "#3b7dd8", "reduce_scatter": "#d8843b", "all_reduce": "#8a4bd8", "compute": "#7fb77e", "stall": "#d83b3b"}


def timeline_svg(sims: dict[str, Simulation], width: int = 1400) -> str:
    """Per graph three lanes: compute (green; red where it stalls at a wait), the communication stream
    (blue all-gathers, orange reduce-scatters, with group names), and live memory."""
    margin, label_w = 10, 90
    rows = []
    y = margin
    for label, sim in sims.items():
        scale = (width - label_w - 2 * margin) / max(sim.total_s, 1e-12)
        x0 = margin + label_w
        rows.append(
            f'<text x="{margin}" y="{y + 14}" font-weight="bold">{html.escape(label)} on {html.escape(sim.profile)}: '
            f"step {_ms(sim.total_s)}, exposed comm {_ms(sim.exposed_comm_s)} ({100 * sim.exposed_fraction:.1f}%), "
            f"peak {_mib(sim.memory.peak_bytes)}</text>"
        )
        y += _ROW
        for lane in _LANES:
            rows.append(f'<text x="{margin}" y="{y + 14}">{lane}</text>')
        for name, start, end in sim.compute_spans:
            if end > start:
                rows.append(_rect(x0 + start * scale, y, (end - start) * scale, _COLORS["compute"], name))
        for c in sim.collectives:
            if c.exposed_s > 0:
                rows.append(_rect(x0 + (c.end_s - c.exposed_s) * scale, y, c.exposed_s * scale, _COLORS["stall"], f"wait {c.name}"))
            rows.append(_rect(x0 + c.start_s * scale, y + _ROW, (c.end_s - c.start_s) * scale, _COLORS[c.kind], f"{c.name} ({c.group})"))
            rows.append(f'<text x="{x0 + c.start_s * scale + 2:.1f}" y="{y + _ROW + 14}" font-size="9">{html.escape(c.group or "")}</text>')
        peak = max(sim.memory.peak_bytes, 1)
        base = y + 3 * _ROW - 2
        points = " ".join(f"{x0 + t * scale:.1f},{base - (_ROW - 4) * live / peak:.1f}" for t, live in sim.memory_points)
        rows.append(f'<polyline fill="none" stroke="#555" points="{points}"><title>live memory, peak {_mib(peak)}</title></polyline>')
        y += 3 * _ROW + margin
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + margin}" font-family="monospace" font-size="11">'
        + "".join(rows) + "</svg>\n"
    )


def _rect(x: float, y: float, w: float, color: str, title: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y + 2}" width="{max(w, 0.5):.1f}" height="{_ROW - 4}" fill="{color}">'
        f"<title>{html.escape(title)}</title></rect>"
    )


def write_timeline(path: str | os.PathLike, sims: dict[str, Simulation]) -> Optional[Path]:
    path = Path(path)
    text = timeline_svg(sims)
    if path.suffix == ".html":
        text = f"<!doctype html><html><body>{text}</body></html>\n"
    path.write_text(text)
    return path
