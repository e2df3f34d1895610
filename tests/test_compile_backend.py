"""The backend's surface: registration and options, misuse errors, dumps and the inspect CLI.

One process on a fake process group of 8 ranks, `aot_eager`.
"""

import re

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from _harness import fake_process_group
from _models import MLPBlock, MLPStack, shard_blocks_then_root
from fsdp_graph import BackendConfig, Compiler, fully_shard
from fsdp_graph.inspect import main as inspect_main
from fsdp_graph.passes.table import PASS_NAMES


@pytest.fixture(autouse=True)
def process_group():
    with fake_process_group(8):
        torch._dynamo.reset()
        yield
    _forget_compiles()


def _forget_compiles():
    # Tests later in this pytest process fork ranks that inherit Dynamo's caches and counters.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _sharded_mlp(num_blocks=2):
    torch.manual_seed(0)
    model = MLPStack(num_blocks=num_blocks)
    shard_blocks_then_root(model)
    return model


def _step(compiled):
    compiled(torch.randn(4, 13)).sum().backward()


def test_string_backend_with_options_dumps_and_inspect_prints_summary(tmp_path, capsys):
    model = _sharded_mlp()
    options = {"compiler": "aot_eager", "dump_dir": str(tmp_path)}
    _step(torch.compile(model, backend="fsdp_graph", options=options))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "summary.json" in names
    for suffix in ("dynamo", "forward", "backward", "joint.reshard_after_forward.before", "joint.reshard_after_forward.after"):
        assert any(n.endswith(f".{suffix}.txt") for n in names), (suffix, names)

    assert inspect_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "forward: 3 collectives" in out and "backward: 5 collectives" in out, out
    for group in ("<root>", "blocks.0", "blocks.1"):
        assert f"total all_gather_into_tensor   {group}" in out, out
        assert f"total reduce_scatter_tensor    {group}" in out, out
    assert "unsharded parameters saved for backward: " in out
    assert "fell back to the eager hooks: none" in out


@pytest.mark.slow  # Inductor compiles cold
def test_inspect_shows_the_schedule_of_an_inductor_dump(tmp_path, capsys):
    """The inspector reads the program as scheduled, before pin_order wraps collectives and waits
    in control_deps (which would hide them): every bucket appears with its wait."""
    _step(torch.compile(_sharded_mlp(), backend=fsdp_graph.backend(compiler="inductor", dump_dir=str(tmp_path))))
    assert inspect_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith(("all_gather_into_tensor_", "reduce_scatter_tensor_"))]
    # Auto-bucketing merges these tiny groups: one gather in forward; one gather, one reduce in backward.
    assert sorted(r[0].split("_tensor")[0] for r in rows) == ["all_gather_into", "all_gather_into", "reduce_scatter"], out
    issue_and_wait = [(int(r[-5]), int(r[-4])) for r in rows]  # ... issue wait prefetch exposed ms
    assert all(0 <= issue < wait for issue, wait in issue_and_wait), out


def test_dump_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_GRAPH_DUMP", str(tmp_path / "dump"))
    _step(torch.compile(_sharded_mlp(), backend=fsdp_graph.backend(compiler=Compiler.AOT_EAGER)))
    assert (tmp_path / "dump" / "summary.json").exists()


def test_inspect_without_a_dump_names_the_fix(tmp_path, capsys):
    assert inspect_main([str(tmp_path)]) == 2
    assert "FSDP_GRAPH_DUMP" in capsys.readouterr().err


class _BreakingBlock(MLPBlock):
    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


def test_fallback_is_logged_and_dumped(tmp_path, capsys, caplog):
    model = MLPStack(num_blocks=2)
    model.blocks[0].__class__ = _BreakingBlock
    shard_blocks_then_root(model)
    with caplog.at_level("WARNING", logger="fsdp_graph"):
        _step(torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir=str(tmp_path))))
    assert "fsdp_graph::fallback (blocks.0)" in caplog.text
    assert "blocks.0" in model._fsdp_state.ctx.fallbacks
    inspect_main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "fell back to the eager hooks:" in out and "  blocks.0: Dynamo ran the module's call in Python" in out


def test_backend_on_a_model_never_sharded_names_fully_shard():
    model = nn.Linear(4, 4)
    compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(2, 4))
    inner = info.value.inner_exception
    assert type(inner) is ValueError
    assert "never sharded" in str(inner) and "fully_shard" in str(inner)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"compiler": "tvm"}, ValueError, r"compiler='tvm' is not one of \['inductor', 'aot_eager'\]"),
        ({"disabled_passes": {"bucketing"}}, ValueError, "'bucketing', which is not a pass; passes: " + re.escape(str(list(PASS_NAMES)))),
        ({"disabled_passes": "reshard_after_forward"}, ValueError, "collection of pass names"),
        ({"dump_dir": 3}, ValueError, "dump_dir must be a path"),
        ({"scope": "layer"}, ValueError, r"scope must be one of \['step', 'block'\], got 'layer'"),
        ({"regions": "all"}, ValueError, r"regions must be one of \['marked', 'blocks'\], got 'all'"),
        ({"rank_divergent_graphs": "yes"}, ValueError, "rank_divergent_graphs must be a bool, got 'yes'"),
        ({"pieces": 1}, ValueError, "pieces must be a bool, got 1"),
        ({"compile": "inductor"}, ValueError, r"Unknown fsdp_graph backend option\(s\) \['compile'\]"),
    ],
)
def test_bad_backend_options(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        fsdp_graph.backend(**kwargs)
    assert type(info.value) is exc


def test_config_or_options_not_both():
    with pytest.raises(TypeError, match="not both"):
        fsdp_graph.backend(BackendConfig(), compiler="aot_eager")
    assert fsdp_graph.backend(BackendConfig(compiler="aot_eager")).config.compiler is Compiler.AOT_EAGER


def test_second_model_in_the_process_compiles_with_static_shapes(tmp_path):
    # Every FSDP class has its own `__call__` code object, so Dynamo does not treat compiling a
    # different model as a recompile of one frame with new shapes (which turns on dynamic shapes).
    from _models import shard_llama, tiny_llama

    _step(torch.compile(_sharded_mlp(), backend=fsdp_graph.backend(compiler="aot_eager")))
    llama = shard_llama(tiny_llama(), fully_shard)
    backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=str(tmp_path))
    torch.compile(llama, backend=backend)(torch.randint(0, 64, (2, 8))).sum().backward()
    (dynamo_graph,) = tmp_path.glob("*.dynamo.txt")
    inputs = [line for line in dynamo_graph.read_text().splitlines() if " = " not in line and ": " in line]
    assert inputs and all(": int" not in line for line in inputs), inputs
