"""Inspecting a dump with the tools people already use: the Chrome trace (Perfetto) of the predicted
schedule beside a measured torch.profiler trace, the SVG timeline, and torch's structured trace
(TORCH_TRACE, tlparse).

One process on a fake process group of 8 ranks, `aot_eager`; the structured trace in a subprocess
(torch reads TORCH_TRACE at import).
"""

import json
import os
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import fsdp_graph
from _harness import fake_process_group, run_process
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph.inspect.dump import format_summary, load_summary
from fsdp_graph.inspect import main as inspect_main
from fsdp_graph.passes.simulator import CollectiveSpan, MemoryProfile, Simulation, in_flight
from fsdp_graph.inspect.timeline import load_programs, timeline_svg


@pytest.fixture(autouse=True)
def process_group():
    with fake_process_group(8):
        torch._dynamo.reset()
        yield
    # Tests later in this pytest process fork ranks that inherit Dynamo's caches and counters.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _compiled_mlp(dump_dir):
    torch.manual_seed(0)
    model = MLPStack(num_blocks=2)
    shard_blocks_then_root(model)
    return torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir=str(dump_dir)))


def _step(compiled):
    compiled(torch.randn(4, 13)).sum().backward()


# -- Chrome trace ------------------------------------------------------------------------------------


def validate_trace_events(trace) -> list[dict]:
    """The trace-event format's requirements (the JSON Object Format of the Trace Event Format spec,
    as Perfetto and chrome://tracing read it): a `traceEvents` list; every event has name, ph, ts,
    pid, tid; "X" events a non-negative dur; "C" events args of numbers; "M" events are metadata
    naming processes and threads (args.name) or ordering them (args.sort_index). Returns the events."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    events = trace["traceEvents"]
    for e in events:
        missing = {"name", "ph", "ts", "pid", "tid"} - e.keys()
        assert not missing, (missing, e)
        assert isinstance(e["name"], str) and isinstance(e["ph"], str) and len(e["ph"]) == 1, e
        assert isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name", "process_sort_index", "thread_sort_index",
                                 "process_labels"}, e
            key = "name" if e["name"].endswith("_name") else "sort_index" if "sort" in e["name"] else "labels"
            assert key in e["args"], e
    json.dumps(trace)  # plain JSON: no NaN-only types, no objects
    return events


def test_trace_of_the_predicted_schedule_beside_a_measured_one(tmp_path, capsys):
    compiled = _compiled_mlp(tmp_path / "dump")
    _step(compiled)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(compiled)
    prof.export_chrome_trace(str(tmp_path / "measured.json"))

    out = tmp_path / "trace.json"
    assert inspect_main([str(tmp_path / "dump"), "--profile", "h100-nvlink", "--trace", str(out),
                         "--measured", str(tmp_path / "measured.json")]) == 0
    events = validate_trace_events(json.loads(out.read_text()))

    # The whole step is one graph: the runtime's hooks issued no all-gather of their own.
    assert "eager runtime's all-gathers (measured): none" in capsys.readouterr().out
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes[1] == "predicted on h100-nvlink", processes
    assert names[(1, 1)] == "compute" and names[(1, 2)] == "collectives (8 ranks)", names
    measured = {pid: name for pid, name in processes.items() if pid != 1}
    assert measured and all(name.startswith("measured: ") for name in measured.values()), processes
    assert any(e["pid"] in measured and e["ph"] == "X" and e["name"].startswith("aten::") for e in events)
    # Every pid and tid an event uses has a name.
    for e in events:
        assert e["pid"] in processes, e
        if e["ph"] == "X" and e["pid"] == 1:
            assert (e["pid"], e["tid"]) in names, e

    # The slices carry the bytes the summary lists (the schedule buckets groups together, so
    # compare totals per graph and op), forward first.
    summary = load_summary(tmp_path / "dump")["graphs"]
    (graph_id,) = summary
    expected, predicted = {}, {}
    for kind in ("forward", "backward"):
        for c in summary[graph_id][kind]["collectives"]:
            sizes = expected.setdefault((kind, c["op"].split("_into")[0].removesuffix("_tensor")), [0, 0])
            sizes[0] += max(c["bytes"], c["input_bytes"])
            sizes[1] += min(c["bytes"], c["input_bytes"])
    slices = sorted((e for e in events if e["pid"] == 1 and e.get("cat") == "collective"), key=lambda e: e["ts"])
    for e in slices:
        sizes = predicted.setdefault((e["args"]["graph"].rsplit(".", 1)[1], e["name"].split()[0]), [0, 0])
        sizes[0] += e["args"]["bytes (all ranks)"]
        sizes[1] += e["args"]["bytes (per rank)"]
    assert predicted == expected
    kinds = [e["args"]["graph"].rsplit(".", 1)[1] for e in slices]
    assert kinds == sorted(kinds, key=lambda k: k != "forward"), kinds
    for e in slices:
        assert e["args"]["issue node"] and e["args"]["wait node"], e
    memory = [e for e in events if e["ph"] == "C"]
    assert memory and max(e["args"]["MiB"] for e in memory) > 0


def test_text_view_prints_the_collectives_in_flight_of_every_graph(tmp_path, capsys):
    _step(_compiled_mlp(tmp_path / "dump"))
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "dump")]) == 0
    lines = capsys.readouterr().out.splitlines()
    programs = load_programs(tmp_path / "dump")
    assert set(programs) == {"frame_0_0.forward", "frame_0_0.backward"}, programs.keys()
    for label, program in programs.items():
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{label} on cpu-gloo:"))
        assert lines[at + 1] == f"  max collectives in flight: {in_flight(program)[1]}", lines[at : at + 2]


def test_measured_gathers_of_a_step_compiled_block_by_block(tmp_path, capsys):
    """Compile scope "block": no graph predicts the collectives, the runtime's hooks issue them.
    `--measured` alone lists each all-gather with the hook that issued it: in backward each block's
    is issued in the hook of the block after it (FSDP2's implicit backward prefetch), across the
    block boundary; in forward each group gathers in its own hook."""
    torch.manual_seed(0)
    model = MLPStack(num_blocks=3)
    shard_blocks_then_root(model)
    compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", scope="block",
                                                               dump_dir=str(tmp_path / "dump")))
    _step(compiled)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(compiled)
    prof.export_chrome_trace(str(tmp_path / "measured.json"))
    assert inspect_main([str(tmp_path / "dump"), "--measured", str(tmp_path / "measured.json")]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("  forward") or line.startswith("  backward")]
    forward = [(words[1], words[-1] if words[-1] != "prefetched" else words[-2]) for words in lines if words[0] == "forward"]
    assert [group for group, _ in forward] == ["<root>", "blocks.0", "blocks.1", "blocks.2"], out
    assert not any(words[-1] == "prefetched" for words in lines if words[0] == "forward"), out
    backward = [(words[1], words[-2]) for words in lines if words[0] == "backward" and words[-1] == "prefetched"]
    assert backward == [("blocks.1", "(blocks.2)"), ("blocks.0", "(blocks.1)")], out
    assert "prefetched (issued in another group's hook): 2 of" in out, out


def test_measured_trace_that_is_not_json_names_the_fix(tmp_path, capsys):
    _step(_compiled_mlp(tmp_path / "dump"))
    (tmp_path / "bad.json").write_text("not json")
    assert inspect_main([str(tmp_path / "dump"), "--trace", str(tmp_path / "t.json"), "--measured", str(tmp_path / "bad.json")]) == 2
    assert "export_chrome_trace" in capsys.readouterr().err


# -- SVG ---------------------------------------------------------------------------------------------


def _text_boxes(svg: str) -> list[tuple[str, float, float, float, float]]:
    """Each <text>'s (text, left, top, right, bottom), from its font size and monospace glyph width."""
    root = ET.fromstring(svg)
    default_size = float(root.get("font-size"))
    boxes = []
    for t in root.iter("{http://www.w3.org/2000/svg}text"):
        size = float(t.get("font-size", default_size))
        width = 0.6 * size * len(t.text)
        x, y = float(t.get("x")), float(t.get("y"))
        left = {"start": x, "middle": x - width / 2, "end": x - width}[t.get("text-anchor", "start")]
        boxes.append((t.text, left, y - 0.8 * size, left + width, y + 0.2 * size))
    return boxes


def _simulation(num_collectives: int, group_name: str) -> Simulation:
    """A made-up schedule: one compute node per collective, each collective tiny beside it."""
    spans = [(f"mm_{i}", i * 1e-3, (i + 1) * 1e-3) for i in range(num_collectives)]
    collectives = [
        CollectiveSpan(f"ag_{i}", "all_gather" if i % 2 else "reduce_scatter", f"{group_name}.{i}", 3 << 20,
                       i, i + 1, 1, i * 1e-3, i * 1e-3, i * 1e-3 + 5e-5 * (1 + i % 7), exposed_s=1e-5 * (i % 2))
        for i in range(num_collectives)
    ]
    live = [(i * 1e-3, (i % 5) << 30) for i in range(num_collectives)]
    memory = MemoryProfile(peak_bytes=4 << 30, peak_at="mm_4", live_bytes=[b for _, b in live])
    return Simulation(num_collectives * 1e-3, num_collectives * 1e-3, 1e-4, 1e-5, spans, collectives, memory,
                      "h100-nvlink", live)


@pytest.mark.parametrize("num_collectives,width", [(3, 1600), (40, 1600), (300, 1600), (40, 500)])
def test_timeline_text_never_overlaps_and_has_scales(num_collectives, width):
    sims = {"frame_0_0.forward": _simulation(num_collectives, "layers"),
            "frame_0_0.backward": _simulation(num_collectives, "model.decoder.layers")}
    svg = timeline_svg(sims, width=width)
    boxes = _text_boxes(svg)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]
            assert not overlap, (a, b)
    texts = [b[0] for b in boxes]
    assert texts.count("time (ms)") == 2 and "0" in texts
    assert any(t.endswith(" GiB") for t in texts), texts  # the memory scale, in the peak's unit
    for legend in ("all-gather", "reduce-scatter", "compute stalled at a wait (exposed communication)"):
        assert legend in texts
    # Group labels appear whole where they fit their box, elided from the front otherwise.
    groups = {c.group for sim in sims.values() for c in sim.collectives}
    labels = [t for t in texts if "layers" in t or t.startswith("~")]
    assert all(t in groups or (t.startswith("~") and any(g.endswith(t[1:]) for g in groups)) for t in labels), labels


def test_timeline_gives_each_parallelism_its_own_collectives_lane():
    """FSDP's and tensor parallelism's collectives run on streams of their own and overlap in time;
    each gets a lane, so their boxes never overlap."""
    sim = _simulation(6, "layers")
    sim.collectives += [
        CollectiveSpan(f"ar_{i}", "all_reduce", "[tp]", 1 << 20, i, i + 1, 0, c.start_s, c.start_s, c.end_s,
                       parallelism="tp")
        for i, c in enumerate(list(sim.collectives))
    ]
    root = ET.fromstring(timeline_svg({"frame_0_0.forward": sim}))
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "fsdp collectives" in texts and "tp collectives" in texts
    boxes = [(float(r.get("x")), float(r.get("y")), float(r.get("x")) + float(r.get("width")))
             for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.find("{http://www.w3.org/2000/svg}title") is not None
             and r.find("{http://www.w3.org/2000/svg}title").text.startswith(("ag_", "ar_"))]
    assert len(boxes) == 12
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[1] == b[1] and a[0] < b[2] and b[0] < a[2]), (a, b)


# -- structured trace (tlparse) ----------------------------------------------------------------------


def _artifacts(trace_dir: Path) -> list[dict]:
    """The artifact records of every structured-trace log in `trace_dir`: the JSON after "] " on
    each line that is not a payload line (payload lines start with a tab)."""
    records = []
    for log in trace_dir.glob("*.log"):
        for line in log.read_text().splitlines():
            if line.startswith("\t") or "] " not in line:
                continue
            record = json.loads(line.split("] ", 1)[1])
            if "artifact" in record:
                records.append(record)
    return records


@pytest.mark.slow  # relaunches Python
def test_dump_goes_into_torch_structured_trace(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _harness import fake_process_group
        from _models import MLPStack, shard_blocks_then_root
        with fake_process_group(8):
            model = MLPStack(num_blocks=2)
            shard_blocks_then_root(model)
            compiled = torch.compile(model, backend="fsdp_graph", options={{"compiler": "aot_eager"}})
            compiled(torch.randn(4, 13)).sum().backward()
    """)
    env = {**os.environ, "TORCH_TRACE": str(tmp_path / "trace")}
    env.pop("FSDP_GRAPH_DUMP", None)
    done = run_process([sys.executable, "-c", script], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _artifacts(tmp_path / "trace")
    ours = {r["artifact"]["name"]: r for r in records if r["artifact"]["name"].startswith("fsdp_graph_")}
    for name in ("fsdp_graph_frame_0_0.dynamo", "fsdp_graph_frame_0_0.forward", "fsdp_graph_frame_0_0.backward",
                 "fsdp_graph_frame_0_0.joint.reshard_after_forward.before",
                 "fsdp_graph_frame_0_0.joint.reshard_after_forward.after", "fsdp_graph_summary"):
        assert name in ours, sorted(ours)
        assert ours[name]["frame_id"] == 0 and ours[name]["frame_compile_id"] == 0, ours[name]
        assert ours[name]["has_payload"], ours[name]


def test_summary_names_the_groups_kept_by_the_budget():
    # A group kept unsharded by memory_budget_bytes: its line names the group and the bytes.
    entry = {"collectives": [], "num_nodes": 3, "kept_by_budget": {"layers.0": 3 * 2**20}}
    text = format_summary({"graphs": {"frame_0_0": {"forward": entry}}})
    assert "kept unsharded by memory_budget_bytes: layers.0: costs 3.0 MiB" in text, text
