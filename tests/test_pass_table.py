"""The pass table (passes/table.py) and the runner (passes/pipeline.py).

Everything that lists passes or options is derived from the table: the backend's options and their
checks, both compile-cache keys, the docs' list, the inspector's pass times. A new pass with one
option is one file plus one table entry: the worked example of docs/compiler.md is applied to a
copy of the sources and compiled.
"""

import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_graph
from _harness import fake_process_group, run_process
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph import BackendConfig
from fsdp_graph.compile.backend import FSDPGraphBackend
from fsdp_graph.inspect import main as inspect_main
from fsdp_graph.passes.check_collectives import CHECK_COLLECTIVES_ENV
from fsdp_graph.passes.pipeline import GraphPass, PassPipeline
from fsdp_graph.passes.table import OPTIONS, PASSES, Stage, format_table

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "compiler.md"


def test_every_option_is_a_checked_backend_field():
    defaults = BackendConfig()
    for option in OPTIONS:
        assert getattr(defaults, option.name) == option.default, option.name
        assert option.name in BackendConfig.__doc__, option.name
        assert getattr(BackendConfig(**{option.name: option.example}), option.name) == option.example
        with pytest.raises(ValueError, match=rf"  - {option.name} must be .*, got 'nonsense'"):
            BackendConfig(**{option.name: "nonsense"})
        assert getattr(fsdp_graph.backend(**{option.name: option.example}).config, option.name) == option.example


def _keys(config: BackendConfig) -> dict[str, str]:
    """Our passes' uuids, Inductor's FX graph cache key and AOTAutogradCache's key of one small
    graph, under the Inductor config the backend compiles with."""
    from torch._functorch._aot_autograd.autograd_cache import autograd_cache_key
    from torch._functorch._aot_autograd.schemas import AOTConfig
    from torch._guards import TracingContext, tracing
    from torch._inductor.codecache import compiled_fx_graph_hash
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    inputs = [torch.randn(4)]
    gm = make_fx(lambda x: x * 2)(*inputs)
    patches = FSDPGraphBackend(config).inductor_patches(gm, inputs, "graph", None)
    aot_config = AOTConfig(fw_compiler=None, bw_compiler=None, partition_fn=None, decompositions={},
                           num_params_buffers=0, aot_id=0, keep_inference_input_mutations=True)
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), torch._inductor.config.patch(patches):
        return {
            "joint uuid": patches["joint_custom_pre_pass"].uuid(),
            "schedule uuid": patches["post_grad_custom_post_pass"].uuid(),
            "fx graph cache": compiled_fx_graph_hash(gm, inputs, {}, [])[0],
            "aot autograd cache": autograd_cache_key(gm, inputs, aot_config)[0],
        }


def _uuid_of(spec) -> str:
    """Which of `_keys`' uuids covers a pass: the joint pass's, or the schedule pass's (scheduling
    and lowering passes)."""
    return "joint uuid" if spec.stage is Stage.JOINT else "schedule uuid"


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before if before[name] != after[name]}


def test_every_option_and_every_pass_reaches_both_cache_keys(monkeypatch):
    """A forgotten option would give stale cache hits: each table-derived option, and switching
    off each pass, changes the uuid of the stage that reads it, and with it Inductor's FX graph
    cache key and AOTAutogradCache's key."""
    monkeypatch.delenv(CHECK_COLLECTIVES_ENV, raising=False)
    default = _keys(BackendConfig())
    assert all(default.values()), default
    for option in OPTIONS:
        changed = _changed(default, _keys(BackendConfig(**{option.name: option.example})))
        uuids = {_uuid_of(spec) for spec in PASSES if option in spec.reads()}
        assert changed == uuids | {"fx graph cache", "aot autograd cache"}, (option.name, changed)
    for spec in PASSES:
        if spec.enabled_by is not None:  # off by default: switching it off changes nothing
            continue
        changed = _changed(default, _keys(BackendConfig(disabled_passes={spec.name})))
        assert changed == {_uuid_of(spec), "fx graph cache", "aot autograd cache"}, (spec.name, changed)


def test_dumping_turns_the_caches_off():
    inputs = [torch.randn(4)]
    gm = make_fx(lambda x: x * 2)(*inputs)
    from fsdp_graph.inspect.dump import GraphDump

    patches = FSDPGraphBackend(BackendConfig()).inductor_patches(gm, inputs, "graph", GraphDump(None))
    assert patches["joint_custom_pre_pass"].uuid() is None and patches["post_grad_custom_post_pass"].uuid() is None


def test_the_docs_list_is_the_table(capsys):
    text = DOCS.read_text()
    start = text.index("<!-- pass table -->\n") + len("<!-- pass table -->\n")
    end = text.index("<!-- end of pass table -->")
    assert text[start:end] == format_table(), "docs/compiler.md's list is stale: paste `python -m fsdp_graph.inspect --passes`"
    assert inspect_main(["--passes"]) == 0
    assert capsys.readouterr().out == format_table()


def test_the_docs_options_table_is_made_from_the_config():
    """docs/compiler.md's options table is what tools/options_table.py makes from `BackendConfig`'s
    fields and their docstrings: one row per option of `fsdp_graph.backend(...)`."""
    from fsdp_graph.compile.option_docs import field_docs, options_table

    text = DOCS.read_text()
    start = text.index("<!-- options table -->\n") + len("<!-- options table -->\n")
    end = text.index("<!-- end of options table -->")
    table = options_table(BackendConfig)
    assert text[start:end] == table, "docs/compiler.md's options table is stale: paste `python tools/options_table.py`"
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert rows == [f.name for f in dataclasses.fields(BackendConfig)]
    documented = set(field_docs(BackendConfig)) | {o.name for o in OPTIONS}
    assert documented == set(rows), set(rows) ^ documented
    script = run_process([sys.executable, str(REPO / "tools" / "options_table.py")])
    assert script.returncode == 0 and script.stdout == table, script.stderr


class _Sink:
    def __init__(self):
        self.graphs, self.times = [], []

    def write_graph(self, gm, label):
        self.graphs.append(label)

    def record_pass(self, graph_id, stage, name, seconds):
        self.times.append((graph_id, stage, name, seconds))


def test_the_runner_recompiles_after_a_change_only_and_times_and_dumps_each_pass():
    gm = make_fx(lambda x: x + 1)(torch.zeros(2))
    add = next(n for n in gm.graph.nodes if n.op == "call_function")

    def to_mul(gm):
        add.target = torch.ops.aten.mul.Tensor
        return gm

    def look(gm):
        return gm

    recompiles = []
    original = gm.recompile
    gm.recompile = lambda: recompiles.append(1) or original()
    sink = _Sink()
    passes = [GraphPass("look", look), GraphPass("to_mul", to_mul), GraphPass("off", look)]
    out = PassPipeline("schedule", passes, frozenset({"off"}), sink)(gm, "g.forward")
    assert len(recompiles) == 1 and torch.equal(out(torch.full((2,), 3.0)), torch.full((2,), 3.0))
    assert sink.graphs == ["g.forward.schedule.look.before", "g.forward.schedule.look.after",
                           "g.forward.schedule.to_mul.before", "g.forward.schedule.to_mul.after"]
    assert [t[:3] for t in sink.times] == [("g.forward", "schedule", n) for n in ("look", "to_mul", "off")]
    assert all(s >= 0 for *_, s in sink.times[:2]) and sink.times[2][3] is None


def test_the_inspector_prints_each_pass_seconds_for_a_dumped_step(tmp_path, capsys):
    with fake_process_group(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = shard_blocks_then_root(MLPStack(num_blocks=2))
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=str(tmp_path), disabled_passes={"auto_bucket"})
        torch.compile(model, backend=backend)(torch.randn(4, 13)).sum().backward()
        torch._dynamo.reset()
    passes = json.loads((tmp_path / "summary.json").read_text())["passes"]
    assert set(passes["frame_0_0"]["joint"]) == {"unshard_selection", "reshard_after_forward"}
    assert passes["frame_0_0.forward"]["schedule"]["auto_bucket"] is None
    assert inspect_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = re.search(r"^frame_0_0 seconds per pass +joint +forward +backward$", out, re.M)
    assert header, out
    rows = out[header.end():].splitlines()[1:]
    names = [r.split()[0] for r in rows if r.startswith("  ")]
    ran = [s.name for s in PASSES if not s.inductor_only and s.enabled_by is None]
    assert names[: len(ran) + 1] == ran + ["all"], out
    assert re.search(r"^  auto_bucket +off +off$", out, re.M), out
    assert re.search(r"^  reorder_for_overlap +\d+\.\d{3} +\d+\.\d{3}$", out, re.M), out


def _doc_block(text: str, first_line: str) -> str:
    """The body of the code block in the docs whose first line is `first_line`."""
    match = re.search(r"```python\n(" + re.escape(first_line) + r"\n.*?)```", text, re.S)
    assert match, first_line
    return match.group(1)


_NEW_PASS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import fsdp_graph
from fsdp_graph import BackendConfig
from fsdp_graph.compile.backend import FSDPGraphBackend
from fsdp_graph.inspect.dump import load_summary
from fsdp_graph.predict import fake_world
from _models import MLPStack, shard_blocks_then_root

assert "wait_late_min_bytes" in BackendConfig.__doc__
try:
    BackendConfig(wait_late_min_bytes=-1)
except ValueError as error:
    print("check:", str(error).splitlines()[-1])
keys = [FSDPGraphBackend(BackendConfig(**kw)).inductor_patches(torch.fx.GraphModule({{}}, torch.fx.Graph()), [], "g", None)
        ["post_grad_custom_post_pass"].uuid() for kw in ({{}}, {{"wait_late_min_bytes": 0}}, {{"disabled_passes": {{"wait_late"}}}})]
print("keys differ:", len(set(keys)) == 3)
with fake_world(2):
    model = shard_blocks_then_root(MLPStack(num_blocks=2))
    backend = fsdp_graph.backend(compiler="aot_eager", dump_dir={dump!r}, wait_late_min_bytes=0)
    torch.compile(model, backend=backend)(torch.randn(4, 13)).sum().backward()
print("seconds:", json.dumps(load_summary({dump!r})["passes"]["frame_0_0.backward"]["schedule"]["wait_late"]))
"""


@pytest.mark.slow  # relaunches Python on a copy of the sources
def test_a_new_pass_with_one_option_is_one_file_and_one_table_entry(tmp_path):
    """The worked example of docs/compiler.md, applied to a copy of the sources: the new file, and
    the entry (with its import) in the table. The option is then a checked backend option in the
    cache key, the pass runs, and its seconds are in the dump."""
    text = DOCS.read_text()
    new_file = _doc_block(text, "# passes/wait_late.py")
    entry = _doc_block(text, "# passes/table.py: the import, and the entry in PASSES")
    import_line, spec = entry.split("\n", 2)[1], entry.split("\n", 2)[2]
    package = tmp_path / "src" / "fsdp_graph"
    shutil.copytree(REPO / "fsdp_graph", package, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("runtime", "passes"):
        shutil.copytree(REPO / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "passes" / "wait_late.py").write_text(new_file)
    table = (package / "passes" / "table.py").read_text()
    anchor = '    PassSpec(\n        "plain_all_gathers_on_gloo"'
    assert table.count(anchor) == 1
    table = table.replace(anchor, spec + anchor).replace("from .gloo import", import_line + "\nfrom .gloo import")
    (package / "passes" / "table.py").write_text(table)

    dump = tmp_path / "dump"
    script = _NEW_PASS_SCRIPT.format(tests=str(REPO / "tests"), dump=str(dump))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    done = run_process([sys.executable, "-c", script], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "check:   - wait_late_min_bytes must be a non-negative int, got -1" in out, out
    assert "keys differ: True" in out, out
    assert re.search(r"^seconds: \d+\.\d+", out, re.M), out
    assert (dump / "frame_0_0.backward.schedule.wait_late.after.txt").exists()
