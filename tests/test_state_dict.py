"""State dicts: DTensor shards under unchanged keys, DCP round trips across world sizes and to and
from unsharded models."""

import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from _harness import run_ranks
from _models import batch_for_step, loss_fn, shard_llama, tiny_llama
from fsdp_graph import fully_shard


def _trained(rank, world_size, sharded=True, steps=2):
    """A tiny Llama after `steps` AdamW steps on the global batch (sharded or not)."""
    torch.manual_seed(0)
    model = tiny_llama()
    if sharded:
        shard_llama(model, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        if sharded:
            loss_fn(model, model(lx), ly).backward()
        else:
            loss_fn(model, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor().clone()
        elif torch.is_tensor(v):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _state_dict_is_local(rank, world_size):
    model, _ = _trained(rank, world_size)
    reference, _ = _trained(rank, world_size, sharded=False)
    with CommDebugMode() as mode:
        state = model.state_dict()
    assert mode.get_total_counts() == 0
    assert list(state) == list(reference.state_dict())
    for key, value in state.items():
        assert isinstance(value, DTensor), key
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[key], rtol=1e-5, atol=1e-5)


def test_state_dict_is_dtensors_without_communication():
    run_ranks(_state_dict_is_local, 2)


def _save(rank, world_size, path, sharded):
    model, opt = _trained(rank, world_size, sharded=sharded)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _full(model_state), _full(optim_state)


def _load(rank, world_size, path, sharded):
    torch.manual_seed(1)  # different weights: everything must come from the checkpoint
    model = tiny_llama()
    if sharded:
        shard_llama(model, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, opt)
    return _full(model_state), _full(optim_state)


def _assert_same(saved, loaded):
    (model_a, optim_a), (model_b, optim_b) = saved, loaded
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for key, per_param in optim_a["state"].items():
        for name, value in per_param.items():
            torch.testing.assert_close(optim_b["state"][key][name], value, rtol=0, atol=0)


def test_dcp_round_trip_reshards_on_load_at_other_world_sizes():
    path = tempfile.mkdtemp(prefix="fsdp_graph_dcp_")
    saved = run_ranks(_save, 2, path, True)
    for world_size in (1, 2, 4):
        _assert_same(saved, run_ranks(_load, world_size, path, True))


def test_dcp_between_sharded_and_unsharded_models():
    sharded_path = tempfile.mkdtemp(prefix="fsdp_graph_dcp_")
    saved = run_ranks(_save, 2, sharded_path, True)
    _assert_same(saved, run_ranks(_load, 1, sharded_path, False))  # into a plain model

    plain_path = tempfile.mkdtemp(prefix="fsdp_graph_dcp_")
    saved = run_ranks(_save, 1, plain_path, False)  # a plain model's checkpoint
    _assert_same(saved, run_ranks(_load, 2, plain_path, True))  # into a sharded one


def _full_state_dict(rank, world_size):
    model, _ = _trained(rank, world_size)
    reference, _ = _trained(rank, world_size, sharded=False)
    full, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=True))
    offloaded, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # with cpu_offload only rank 0 holds the full state
        assert all(torch.equal(offloaded[k], full[k]) for k in full)
    else:
        assert offloaded == {}
    plain = tiny_llama()
    plain.load_state_dict(full)  # an unsharded model takes it as is
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-5, atol=1e-5)
    # and a sharded model takes a full state dict back
    torch.manual_seed(3)
    again = shard_llama(tiny_llama(), fully_shard)
    set_state_dict(again, [], model_state_dict=plain.state_dict(), optim_state_dict={},
                   options=StateDictOptions(full_state_dict=True))
    for key, value in again.state_dict().items():
        assert torch.equal(value.full_tensor(), plain.state_dict()[key]), key


def test_full_state_dict_round_trip_with_unsharded_model():
    run_ranks(_full_state_dict, 2)
