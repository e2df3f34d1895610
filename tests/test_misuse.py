"""More misuse (with tests/test_errors.py): each fails early with a ValueError or TypeError naming the fix.

These cover mistakes made after `fully_shard` returned: loading, optimizers, calling parts of a
group, changing parameters behind the group's back. One process, fake 4-rank group.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from _harness import fake_process_group
from test_errors import _raises
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph import fully_shard, register_fsdp_forward_method
from fsdp_graph.runtime.param import MetaParameterError


@pytest.fixture(autouse=True)
def process_group():
    with fake_process_group(4):
        yield


def _sharded_mlp():
    torch.manual_seed(0)
    model = MLPStack()
    return shard_blocks_then_root(model)


def _step(model):
    model(torch.randn(4, 13)).sum().backward()


def test_state_dict_of_wrong_shape_names_every_key():
    model = _sharded_mlp()
    state = model.state_dict()
    state["inp.weight"] = torch.zeros(3, 3)
    state["blocks.1.up.bias"] = distribute_tensor(torch.zeros(7), state["blocks.1.up.bias"].device_mesh, [Shard(0)])
    err = _raises(ValueError, r"'inp.weight' has shape \(3, 3\), the parameter has shape \(13, 13\)", model.load_state_dict, state)
    assert "'blocks.1.up.bias' has shape (7,), the parameter has shape (5,)" in str(err)


def test_full_plain_state_dict_names_set_state_dict():
    model = _sharded_mlp()
    plain = MLPStack().state_dict()
    err = _raises(ValueError, "'inp.weight' is a plain tensor.*full_state_dict=True", model.load_state_dict, plain)
    assert "'head.bias'" in str(err)  # every key, not just the first
    _raises(ValueError, "plain tensor", model.load_state_dict, plain, assign=True)


def test_submodule_of_a_group_called_on_its_own():
    model = _sharded_mlp()
    x = torch.randn(2, 13)
    _raises(ValueError, r"Linear was called on its own.*\['inp.weight', 'inp.bias'\].*fully_shard\(submodule\)", model.inp, x)
    _raises(ValueError, r"\['up.weight', 'up.bias'\] are sharded in the fully_shard group of 'blocks.0'", model.blocks[0].up, x)
    model.unshard()  # gathered by hand: allowed
    assert model.inp(x).shape == (2, 13)
    model.reshard()


def test_submodule_called_on_its_own_after_a_compiled_step():
    # `torch.compile` with a backend not ours runs every group block by block, which lifts the check
    # only while the group's call runs ([Note: Owner checks in block scope] in traced/state.py).
    model = _sharded_mlp()
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager")(torch.randn(4, 13)).sum().backward()
    _raises(ValueError, r"Linear was called on its own.*\['inp.weight', 'inp.bias'\]", model.inp, torch.randn(2, 13))
    _raises(ValueError, r"\['up.weight', 'up.bias'\] are sharded", model.blocks[0].up, torch.randn(2, 13))


def test_optimizer_built_before_fully_shard():
    model = MLPStack()
    optimizer = torch.optim.AdamW(model.parameters())
    fully_shard(model)
    _step(model)
    err = _raises(ValueError, r"AdamW holds parameters that fully_shard .* replaced.*after fully_shard", optimizer.step)
    assert "'inp.weight'" in str(err)
    torch.optim.AdamW(model.parameters()).step()  # built afterwards: fine


def test_optimizer_built_before_load_state_dict_with_assign():
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict({k: v.detach().clone() for k, v in _sharded_mlp().state_dict().items()}, assign=True)
    _step(model)  # the group adopts the assigned parameters
    _raises(ValueError, r"SGD holds parameters that fully_shard \(or a later load_state_dict\(assign=True\)\)", optimizer.step)


def test_step_with_unreduced_gradients():
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)
    _step(model)
    _raises(ValueError, r"not reduced yet.*set_requires_gradient_sync\(True\)", optimizer.step)


def test_step_with_reduce_scatters_in_flight():
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_is_last_backward(False)
    _step(model)
    _raises(ValueError, r"still in flight.*set_is_last_backward\(True\)", optimizer.step)


def test_mesh_without_this_rank():
    mesh = DeviceMesh("cpu", [2, 3])  # this process is global rank 0
    _raises(ValueError, r"mesh \[2, 3\] does not include this process \(global rank 0 of 4\)", fully_shard, nn.Linear(4, 4), mesh=mesh)


def test_module_listed_twice():
    a = nn.Linear(4, 4)
    _raises(ValueError, "same Linear twice .* list each module once", fully_shard, [a, nn.Linear(4, 4), a])


def test_scalar_and_dtensor_parameters_are_listed_together():
    m = nn.Linear(4, 4)
    m.temperature = nn.Parameter(torch.tensor(1.0))
    mesh = init_device_mesh("cpu", (4,))
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(1)]))
    err = _raises(ValueError, "'temperature' is a 0-dim .* ignored_params", fully_shard, m)
    assert "'weight' is a DTensor on mesh DeviceMesh((4,)" in str(err)
    assert "needs both to be named axes of one mesh" in str(err)


def test_meta_parameters_at_first_forward():
    with torch.device("meta"):
        model = MLPStack()
    fully_shard(model)
    # A ValueError and a RuntimeError (FSDP2's type): tests/test_group_conformance.py.
    _raises(MetaParameterError, "still on the meta device.*to_empty", _step, model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    _step(model)  # materialized: trains


def test_method_argument_types():
    model = _sharded_mlp()
    _raises(TypeError, "async_op must be a bool, got 'yes'", model.unshard, async_op="yes")
    _raises(TypeError, r"method's name as a str, got 3.*'generate'", register_fsdp_forward_method, model, 3)
