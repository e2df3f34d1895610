"""`fsdp_graph.precompile`: a compiled step saved by one launch and loaded by the next.

Each `run_ranks` call starts two fresh gloo processes, as a relaunch does. The model is defined in a
file of the test's own, so that one launch can run after its source changed. Every launch trains
against an unsharded copy of the model on the same global batch (`train_and_compare`): losses and
gradients every step, parameters at the end.
"""

import copy
import importlib
import io
import os
import pickle
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.tensor import distribute_tensor

import fsdp_graph
from _harness import run_ranks
from _models import (
    batch_for_step, check_grads_match, check_params_match, global_mean, loss_fn, shard_blocks_then_root, train_and_compare,
)
from fsdp_graph import fully_shard
from fsdp_graph.predict import fake_world

_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.{activation}(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)
'''


def _launch(rank, world_size, model_dir, save_dir, global_batch, backend_options=None):
    sys.path.insert(0, model_dir)
    import precompiled_net

    torch.manual_seed(0)
    result = {}

    def shard(model):
        shard_blocks_then_root(model)
        example = batch_for_step(model, 0, 8, rank, world_size)[2]
        counters.clear()
        backend = fsdp_graph.backend(**backend_options) if backend_options else "fsdp_graph"
        compiled = fsdp_graph.precompile(model, (example,), save_dir=save_dir, backend=backend)
        result["source"] = getattr(compiled, "source", "not saved")  # precompile warned and returned torch.compile's
        result["graphs_traced"] = counters["stats"]["unique_graphs"]
        if compiled.source == "loaded":
            result["aliasing_guards"] = _aliasing_guards(compiled)
            head = model.head  # swapped for a copy: same type and parameters, another object
            model.head = copy.copy(head)
            result["accepts_a_copied_module"] = compiled._compiled.guard_check(model, example)
            model.head = head
        return compiled

    result["losses"] = train_and_compare(precompiled_net.Net(), shard, rank, world_size, steps=3, global_batch=global_batch)
    result["graphs_traced_in_training"] = counters["stats"]["unique_graphs"] - result["graphs_traced"]
    return result


def _aliasing_guards(compiled) -> tuple[int, int]:
    """(guard nodes with a C++ "a is b" check, Python lambdas run after the other guards) of a
    loaded step: [Note: Aliasing guards of a saved step] in fsdp_graph/compile/precompile.py."""
    root = compiled._compiled._artifacts.guard_manager.root
    nodes, relational = [root], 0
    while nodes:
        node = nodes.pop()
        relational += node.has_object_aliasing_guard()
        nodes += node.get_child_managers()
    return relational, len(root.get_epilogue_lambda_guards())


@pytest.mark.slow  # Inductor compiles cold, relaunches
def test_saved_step_is_loaded_by_the_next_launch_and_trains_as_the_reference(tmp_path):
    model_file = tmp_path / "precompiled_net.py"
    model_file.write_text(_MODEL.format(activation="tanh"))
    launch = lambda global_batch=8: run_ranks(_launch, 2, str(tmp_path), str(tmp_path / "saved"), global_batch)

    first = launch()
    assert first["source"] == "compiled" and first["graphs_traced"] == 1, first
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "step.rank0-of-2.bin", "step.rank0-of-2.json", "step.rank1-of-2.bin", "step.rank1-of-2.json"]

    relaunch = launch()  # no tracing at all: Dynamo compiles no graph
    assert relaunch["source"] == "loaded" and relaunch["graphs_traced"] == 0, relaunch
    assert relaunch["graphs_traced_in_training"] == 0, relaunch
    assert relaunch["losses"] == first["losses"]
    # The loaded guards check that objects reached by two paths (a parameter's owner, the module
    # tree) are still one object, in C++; a module swapped for a copy is rejected.
    relational, lambdas = relaunch["aliasing_guards"]
    assert relational > 0 and lambdas == 0, relaunch["aliasing_guards"]
    assert relaunch["accepts_a_copied_module"] is False

    # Batches of another shape than the saved step's: its guards reject them, and torch.compile runs them.
    other_shape = launch(global_batch=4)
    assert other_shape["source"] == "loaded" and other_shape["graphs_traced_in_training"] == 1, other_shape

    # The model's code changed: the saved step traced the old code, so it is compiled again.
    model_file.write_text(_MODEL.format(activation="sigmoid"))
    edited = launch()
    assert edited["source"] == "compiled" and edited["graphs_traced"] == 1, edited
    assert edited["losses"] != first["losses"]


@pytest.mark.slow  # Inductor compiles cold, relaunches
def test_saved_step_with_blocks_as_regions(tmp_path):
    """Blocks whose forward is a torch.compiler.nested_compile_region ([Note: Blocks as compile
    regions]): the step with its region is saved, and the next launch loads it without tracing
    ([Note: Flat region arguments]: nested region arguments left a guard torch cannot serialize)."""
    source = _MODEL.format(activation="tanh").replace(
        "    def forward(self, x):\n        return x +", "    @torch.compiler.nested_compile_region\n    def forward(self, x):\n        return x +"
    )
    assert "nested_compile_region" in source
    (tmp_path / "precompiled_net.py").write_text(source)
    launch = lambda: run_ranks(_launch, 2, str(tmp_path), str(tmp_path / "saved"), 8)
    first = launch()
    assert first["source"] == "compiled" and first["graphs_traced"] == 1, first
    relaunch = launch()
    assert relaunch["source"] == "loaded" and relaunch["graphs_traced"] == 0, relaunch
    assert relaunch["graphs_traced_in_training"] == 0 and relaunch["losses"] == first["losses"], relaunch


@pytest.mark.slow  # Inductor compiles cold, relaunches
def test_saved_step_with_every_block_a_region(tmp_path):
    """`fsdp_graph.backend(regions="blocks")` ([Note: Every block a compile region]), no block
    marked: precompile captures the step with the regions its backend asks for (`capture_for` in
    traced/regions.py), saves it, and the next launch loads it without tracing."""
    source = _MODEL.format(activation="tanh").replace("range(2)", "range(3)")  # a region used once is inlined
    assert "range(3)" in source
    (tmp_path / "precompiled_net.py").write_text(source)
    options = {"regions": "blocks", "dump_dir": str(tmp_path / "dump")}
    launch = lambda: run_ranks(_launch, 2, str(tmp_path), str(tmp_path / "saved"), 8, options)
    first = launch()
    assert first["source"] == "compiled" and first["graphs_traced"] == 1, first
    forward = next((tmp_path / "dump").glob("*.forward.txt")).read_text()
    assert forward.count("= invoke_subgraph(") == 2, forward  # blocks.1 and .2; blocks.0, the first of its kind, inline
    relaunch = launch()
    assert relaunch["source"] == "loaded" and relaunch["graphs_traced"] == 0, relaunch
    assert relaunch["graphs_traced_in_training"] == 0 and relaunch["losses"] == first["losses"], relaunch


def test_saved_step_with_aot_eager(tmp_path):
    """`compiler="aot_eager"`: the step is saved as torch's own aot_eager saves one (its graphs as
    `AOTEagerOutputCode`), and the next launch loads it without tracing, with the same numbers
    as the first launch and the unsharded model. It used to warn "expected OutputCode" and save
    nothing."""
    (tmp_path / "precompiled_net.py").write_text(_MODEL.format(activation="tanh"))
    options = {"compiler": "aot_eager"}
    launch = lambda: run_ranks(_launch, 2, str(tmp_path), str(tmp_path / "saved"), 8, options)
    first = launch()
    assert first["source"] == "compiled" and first["graphs_traced"] == 1, first
    assert len(list((tmp_path / "saved").glob("*.bin"))) == 2
    relaunch = launch()
    assert relaunch["source"] == "loaded" and relaunch["graphs_traced"] == 0, relaunch
    assert relaunch["graphs_traced_in_training"] == 0 and relaunch["losses"] == first["losses"], relaunch


def test_sharded_classes_pickle_by_name_and_never_shadow_the_library():
    # A saved step's guards name the classes of the modules they check; `FSDP<Cls>` is made at
    # runtime, so pickle must find it by name, in this process and in the next (same name).
    class Module(nn.Module):  # prefixed, the name of fsdp_graph's own FSDPModule
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    with fake_world(2):
        cls = type(fully_shard(Module()))
    assert fsdp_graph.api.FSDPModule is fsdp_graph.FSDPModule and cls is not fsdp_graph.FSDPModule
    assert cls.__name__ == cls.__qualname__ and cls.__name__.startswith("FSDPModule")
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert pickle.loads(pickle.dumps(cls.__call__)) is cls.__call__


def test_an_unsharded_model_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="call fully_shard first"):
        fsdp_graph.precompile(nn.Linear(2, 2), (torch.randn(1, 2),), save_dir=tmp_path)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fsdp_graph.precompile(lambda x: x, (torch.randn(1, 2),), save_dir=tmp_path)


def test_a_change_to_fsdp_graph_itself_changes_the_saved_header(monkeypatch):
    """A saved step was scheduled by our passes, which Dynamo never traced: its header (and the
    compile caches' keys) carry a digest of fsdp_graph's sources, so an edit to e.g.
    passes/reorder.py recompiles it."""
    cache_key = importlib.import_module("fsdp_graph.compile.cache_key")
    before = cache_key.own_sources_digest()
    real_open = open

    def open_edited(path, mode="r", *args, **kwargs):
        if path.endswith(os.path.join("passes", "reorder.py")):
            with real_open(path, mode, *args, **kwargs) as f:
                return io.BytesIO(f.read() + b"\n# edited\n")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(cache_key, "open", open_edited, raising=False)
    assert cache_key.own_sources_digest.__wrapped__() != before



def _launch_assigning(rank, world_size, model_dir, save_dir):
    """A step saved or loaded by `fsdp_graph.precompile`, then every shard replaced by a DTensor with
    new values before the first call (`load_state_dict(assign=True)`, as Accelerate's loading
    does), then steps against an unsharded reference given the same values."""
    sys.path.insert(0, model_dir)
    import precompiled_net

    torch.manual_seed(0)
    reference = precompiled_net.Net()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    example = batch_for_step(model, 0, 8, rank, world_size)[2]
    compiled = fsdp_graph.precompile(model, (example,), save_dir=save_dir)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5).add_(0.125)
    new = {name: distribute_tensor(reference.get_parameter(name).detach().clone(), p.device_mesh, p.placements)
           for name, p in model.named_parameters()}
    model.load_state_dict(new, assign=True)
    counters.clear()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
        ref_loss = loss_fn(reference, reference(x), y)
        ref_loss.backward()
        loss = loss_fn(model, compiled(lx), ly)
        loss.backward()
        losses.append((global_mean(loss), ref_loss.item()))
        check_grads_match(model, reference)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    check_params_match(model, reference, atol=1e-5)
    return compiled.source, losses, counters["stats"]["unique_graphs"]


@pytest.mark.slow  # Inductor compiles cold, relaunches
def test_shards_assigned_after_a_saved_step_is_loaded_are_the_ones_trained(tmp_path):
    # The loaded step gathers the groups' shard buffers in place ([Note: Sharded parameters live in
    # their group's row] in runtime/shard_buffer.py): shards replaced after the load must be what
    # it gathers, and what the optimizer steps.
    (tmp_path / "precompiled_net.py").write_text(_MODEL.format(activation="tanh"))
    launch = lambda: run_ranks(_launch_assigning, 2, str(tmp_path), str(tmp_path / "saved"))
    first = launch()
    relaunch = launch()
    assert (first[0], relaunch[0]) == ("compiled", "loaded")
    # The saved step's guards reject the new parameters, so the loaded launch compiles once more.
    assert relaunch[2] == 1, relaunch
    for source, losses, _ in (first, relaunch):
        for got, expected in losses:
            assert abs(got - expected) <= 1e-5 * abs(expected), (source, losses)
