"""Bad input fails early with a ValueError or TypeError whose message names the fix."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from _harness import fake_process_group
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from fsdp_graph.api.module import ArgumentTypeError


@pytest.fixture(autouse=True)
def process_group():
    with fake_process_group(4):
        yield


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc  # never an AssertionError or a subclass surprise
    return info.value


def test_applying_twice():
    m = MLPStack()
    fully_shard(m)
    _raises(ValueError, "already applied .* once per module", fully_shard, m)


def test_parent_before_child():
    m = MLPStack()
    fully_shard(m)
    _raises(ValueError, "bottom-up", fully_shard, m.blocks[0])


def test_not_a_module():
    _raises(TypeError, "expects an nn.Module", fully_shard, torch.randn(3))
    _raises(TypeError, "expects an nn.Module", fully_shard, [nn.Linear(2, 2), "x"])
    _raises(ValueError, "empty list", fully_shard, [])


def test_container_without_forward():
    _raises(ValueError, "no forward.*shard its children", fully_shard, nn.ModuleList([nn.Linear(2, 2)]))


def test_int_reshard_after_forward_must_divide_shard_group():
    _raises(ValueError, "must divide the shard group size 4", fully_shard, nn.Linear(4, 4), reshard_after_forward=3)
    _raises(ValueError, "must divide", fully_shard, nn.Linear(4, 4), reshard_after_forward=0)
    # A wrong type is a TypeError that is also FSDP2's ValueError, for code written against torch's.
    err = _raises(ArgumentTypeError, "bool, an int or None", fully_shard, nn.Linear(4, 4), reshard_after_forward="yes")
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    _raises(ArgumentTypeError, "bool, an int or None", fully_shard, nn.Linear(4, 4), reshard_after_forward=1.0)
    model = fully_shard(nn.Sequential(fully_shard(nn.Linear(4, 4)), nn.Linear(4, 4)))
    for bad in (2, None, "yes"):
        _raises(ArgumentTypeError, "reshard_after_forward must be a bool", model.set_reshard_after_forward, bad)
    model.set_reshard_after_forward(False, False)  # recurse positionally, as FSDP2 allows
    assert model._fsdp_state.reshard_after_forward is False and model[0]._fsdp_state.reshard_after_forward is not False


def test_mesh_must_be_1d_or_2d():
    mesh = init_device_mesh("cpu", (1, 2, 2))
    _raises(ValueError, "1-D .* or 2-D .* got a 3-D", fully_shard, nn.Linear(4, 4), mesh=mesh)
    _raises(TypeError, "must be a DeviceMesh.*init_device_mesh", fully_shard, nn.Linear(4, 4), mesh="cpu")


def test_policy_types():
    _raises(TypeError, "mp_policy must be a MixedPrecisionPolicy", fully_shard, nn.Linear(2, 2), mp_policy="bf16")
    _raises(TypeError, "offload_policy must be", fully_shard, nn.Linear(2, 2), offload_policy=True)
    _raises(TypeError, r"param_dtype must be a torch.dtype.*torch.bfloat16", MixedPrecisionPolicy, param_dtype="bf16")
    _raises(ValueError, "not a floating-point dtype", MixedPrecisionPolicy, reduce_dtype=torch.int32)
    _raises(TypeError, "cast_forward_inputs must be a bool", MixedPrecisionPolicy, cast_forward_inputs=1)
    _raises(TypeError, "pin_memory must be a bool", CPUOffloadPolicy, pin_memory="yes")


def test_parameters_on_different_devices():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    _raises(ValueError, "different devices.*module.to\\(device\\)", fully_shard, m)


def test_parameter_shared_with_another_group():
    m = Tied()
    fully_shard(m.embed)
    err = _raises(ValueError, r"Parameter 'head.weight' is shared with 'weight'", fully_shard, m)
    assert "fully_shard([module_a, module_b])" in str(err)


def test_ignored_params_must_be_parameters():
    # Parameters of other modules are ignored, as in FSDP2: tests/test_group_conformance.py.
    _raises(TypeError, "hold nn.Parameter objects", fully_shard, nn.Linear(2, 2), ignored_params={torch.ones(2)})
    _raises(TypeError, "set of nn.Parameter", fully_shard, nn.Linear(2, 2), ignored_params=nn.Parameter(torch.ones(2)))


def test_shard_placement_not_shard_or_out_of_range():
    _raises(ValueError, "return Shard\\(dim\\)", fully_shard, nn.Linear(2, 2), shard_placement_fn=lambda p: Replicate())
    _raises(ValueError, "-2 <= dim < 2", fully_shard, nn.Linear(2, 2), shard_placement_fn=lambda p: Shard(2))
    _raises(TypeError, "must be callable", fully_shard, nn.Linear(2, 2), shard_placement_fn=3)


def test_prefetch_targets_must_be_sharded():
    m = MLPStack()
    shard_blocks_then_root(m)
    _raises(ValueError, "not sharded", m.blocks[0].set_modules_to_forward_prefetch, [m.inp])
    _raises(TypeError, "list of FSDPModule", m.blocks[0].set_modules_to_backward_prefetch, m.blocks[1])


def test_method_arguments():
    m = fully_shard(MLPStack())
    _raises(TypeError, "must be a bool", m.set_requires_gradient_sync, "no")
    _raises(TypeError, "must be a bool", m.set_reshard_after_backward, None)
    _raises(ValueError, "positive number", m.set_gradient_divide_factor, 0)
    _raises(ValueError, "has no method 'generate'", register_fsdp_forward_method, m, "generate")


def test_needs_a_process_group():
    dist.destroy_process_group()
    try:
        _raises(ValueError, "init_process_group", fully_shard, nn.Linear(2, 2))
    finally:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)


