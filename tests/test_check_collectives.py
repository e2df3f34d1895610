"""The in-flight collective checks (passes/check_collectives.py, `check_collectives=True`).

The negative tests run hand-built graphs that break the rule on one process with a fake process
group; `test_compiled_step_with_several_in_flight_passes_the_checks` compiles a sharded model there
whose schedule keeps several collectives in flight. On two gloo ranks (several in flight too, see
[Note: All-gathers on gloo]) the checks run in tests/test_compile_parity.py
(`test_gloo_gathers_through_the_plain_allgather_with_several_in_flight`).
"""

import operator

import pytest
import torch
import torch.fx as fx

import fsdp_graph
from _harness import fake_process_group
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph.inspect.timeline import load_programs
from fsdp_graph.passes.simulator import in_flight
from fsdp_graph.compile.backend import BackendConfig
from fsdp_graph.passes.check_collectives import CHECK_COLLECTIVES_ENV, CollectiveBufferError, check_collectives
from fsdp_graph.passes.nodes import C10D
from fsdp_graph.passes.pipeline import run_pass
from fsdp_graph.passes.table import Stage


def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _graph(between=None) -> fx.GraphModule:
    """x -> all_gather(x) -> [between(x)] -> wait -> * 2: `between` runs while the gather is in flight."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    gathered = graph.call_function(C10D.all_gather_into_tensor.default, (x, 8, torch.distributed.group.WORLD.group_name))
    if between is not None:
        graph.call_function(between, (x,))
    waited = graph.call_function(C10D.wait_tensor.default, (gathered,))
    graph.output(graph.call_function(operator.mul, (waited, 2)))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture
def fake_group():
    with fake_process_group(8):
        yield


def test_untouched_buffers_pass(fake_group):
    gm = run_pass(check_collectives, _graph())
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(
        torch.ops.fsdp_graph.check_collective.default
    ) == 1
    out = gm(torch.randn(16))
    assert out.shape == (128,)


def test_a_write_into_an_in_flight_input_raises(fake_group):
    gm = run_pass(check_collectives, _graph(between=_add_one))
    with pytest.raises(CollectiveBufferError, match=r"all_gather_into_tensor_default \(\[0\]\) was in flight when 32 of its input's 64 bytes"):
        gm(torch.zeros(16))


def _add_one(t: torch.Tensor) -> None:
    t.add_(1)


def test_freeing_an_in_flight_input_raises(fake_group):
    gm = run_pass(check_collectives, _graph(between=_free_storage))
    with pytest.raises(CollectiveBufferError, match=r"input's storage was resized from 64 to 0 bytes"):
        gm(torch.zeros(16))


def test_the_environment_variable_turns_the_checks_on(monkeypatch):
    monkeypatch.delenv(CHECK_COLLECTIVES_ENV, raising=False)
    assert not BackendConfig().resolved_options()["check_collectives"]
    monkeypatch.setenv(CHECK_COLLECTIVES_ENV, "1")
    assert BackendConfig().resolved_options()["check_collectives"]
    assert [p.name for p in BackendConfig(compiler="aot_eager").passes(Stage.LOWER)] == ["check_collectives"]
    assert not BackendConfig(check_collectives=False).resolved_options()["check_collectives"]
    with pytest.raises(ValueError, match="check_collectives must be True, False or None"):
        BackendConfig(check_collectives="yes")


def test_compiled_step_with_several_in_flight_passes_the_checks(fake_group, tmp_path):
    # The fake group is no gloo: the schedule prefetches with several collectives in flight, and
    # every one of them is checked at its wait (the inserted check ops run; nothing raises).
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MLPStack(num_blocks=3)
    shard_blocks_then_root(model)
    backend = fsdp_graph.backend(
        compiler="aot_eager", disabled_passes={"auto_bucket"}, dump_dir=str(tmp_path), check_collectives=True
    )
    try:
        torch.compile(model, backend=backend)(torch.randn(4, 13)).sum().backward()
    finally:
        torch._dynamo.reset()
    in_flight_per_graph = {label: in_flight(program)[1] for label, program in load_programs(str(tmp_path)).items()}
    assert max(in_flight_per_graph.values()) >= 2, in_flight_per_graph

