"""Zero-copy buckets (issue #48): each group's sharded parameters are views of one persistent shard
buffer, this rank's all-gather row, which the eager and the traced all-gather read in place. See
[Note: Sharded parameters live in their group's row] in runtime/shard_buffer.py.

Training is checked against torch's `fully_shard` bit for bit (eager, and compiled with aot_eager),
Muon against torch's on an unsharded model, and what each all-gather reads against the shards'
own storage, on 2 gloo ranks.
"""

import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from _harness import run_ranks
from _models import MLPStack
from fsdp_graph import fully_shard
from fsdp_graph.optim import Muon

# op -> the position of the input it reads: eager c10d, traced functional (gloo's rewrite included)
_ALL_GATHER_INPUTS = {
    "c10d::_allgather_base_": 1,
    "_c10d_functional::all_gather_into_tensor": 0,
    "_c10d_functional::all_gather_into_tensor_out": 0,
}


class _AllGatherInputs(TorchDispatchMode):
    """The storage (data pointer) and size of every all-gather's input, as issued."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        position = _ALL_GATHER_INPUTS.get(func.name())
        if position is not None:
            t = args[position]
            self.inputs.append((t.untyped_storage().data_ptr(), t.numel()))
        return func(*args, **(kwargs or {}))


class Uneven(nn.Module):
    """Groups with padding (7 and 9 rows over 2 ranks), biases, a frozen layer in the root's group
    and a layer sharded on dim 1 (10 columns: torch's fully_shard shards dim k > 0 only evenly),
    whose shard keeps its own storage and is copied in."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(7, 9 + i), nn.Tanh(), nn.Linear(9 + i, 7)) for i in range(2)
        )
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(torch.tanh(self.frozen(h))).squeeze(-1)


def _shard(model: Uneven, fs) -> Uneven:
    dim1 = model.blocks[1][2].weight  # (7, 10): 10 columns over 2 ranks

    def placement(param: nn.Parameter):
        return Shard(1) if param is dim1 else None

    for block in model.blocks:
        fs(block, shard_placement_fn=placement)
    return fs(model)


def _buffer_views(model: nn.Module) -> dict[str, bool]:
    """Per sharded parameter on dim 0 (by name): whether its local tensor is a view of its group's
    shard buffer (same storage, and the buffer's attribute on it)."""
    found = {}
    names = {p: n for n, p in model.named_parameters()}
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if state is None or state.group is None or state.group.shard_buffer is None:
            continue
        flat = state.group.shard_buffer.flat
        for p in state.group.params:
            if p.shard_dim == 0:
                local = p.sharded_param.to_local()
                found[names[p.sharded_param]] = local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    return found


def _step_storages(model: nn.Module) -> set[int]:
    """The storages of every group's shard buffer."""
    return {
        m._fsdp_state.group.shard_buffer.flat.untyped_storage().data_ptr()
        for m in model.modules()
        if getattr(m, "_fsdp_state", None) is not None and m._fsdp_state.group is not None
    }


def _train_against_torch(rank, world_size, compiler):
    torch.manual_seed(0)
    reference = Uneven()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 6, generator=gen) for _ in range(3)]
    targets = [torch.randn(8, generator=gen) for _ in range(3)]
    runs, gathered = {}, []
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model = _shard(copy.deepcopy(reference), fs)
        run = model
        if name == "ours" and compiler is not None:
            run = torch.compile(model, backend=fsdp_graph.backend(compiler=compiler))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        losses, grads, params = [], [], []
        for x, y in zip(batches, targets):
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            # Eager steps: the storage each all-gather reads. A dispatch mode would send Dynamo's
            # frames to the eager hooks, so compiled steps are profiled instead: their ops.
            capture = _AllGatherInputs() if compiler is None else torch.profiler.profile()
            with capture:
                loss = nn.functional.mse_loss(run(x), y)
                loss.backward()
            if name == "ours" and compiler is None:
                gathered.append(capture.inputs)
            elif name == "ours":
                gathered.append(sorted(e.name for e in capture.events() if e.name.startswith("fsdp_graph::")))
            losses.append(loss.item())
            grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()  # set_to_none, torch's default
            params.append({n: p.to_local().clone() for n, p in model.named_parameters()})
        runs[name] = (losses, grads, params)
    return runs, gathered, _buffer_views(model), _step_storages(model), dict(counters["stats"])


@pytest.mark.parametrize("compiler", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_training_matches_torch_fully_shard_and_gathers_read_the_buffers(compiler):
    runs, gathered, views, buffers, stats = run_ranks(_train_against_torch, 2, compiler)
    (losses, grads, params), (their_losses, their_grads, their_params) = runs["ours"], runs["torch"]
    assert losses == their_losses
    for step in range(len(losses)):
        assert grads[step].keys() == their_grads[step].keys()
        for name, grad in their_grads[step].items():
            assert torch.equal(grads[step][name], grad), f"step {step}: grad of {name}"
        for name, param in their_params[step].items():
            assert torch.equal(params[step][name], param), f"step {step}: {name}"
    # After three optimizer steps every dim-0 shard still lives in its group's buffer ...
    assert views and all(views.values()), views
    # ... and every all-gather of every step read one of those buffers itself: no copy-in, except
    # the block with a shard on dim 1, whose shard is copied into its slot first, the slot being
    # in the buffer all the same.
    if compiler is None:
        for step_inputs in gathered:
            assert step_inputs and all(ptr in buffers for ptr, _ in step_inputs), (step_inputs, buffers)
    else:
        # One graph for the whole step (no fallback to the eager hooks), and of its five gathers
        # (the root's once, each block's in forward and again in backward) only block 1's two copy
        # in: its shard on dim 1 keeps its own storage, so that group traces the copy-in.
        assert stats.get("unique_graphs") == 1, stats
        for step_ops in gathered[1:]:  # the first step also traced the ops
            counts = collections.Counter(step_ops)
            assert 5 * counts["fsdp_graph::copy_in"] == 2 * counts["fsdp_graph::copy_out"] > 0, counts


def _profiled_step(model, x) -> set[str]:
    with torch.profiler.profile() as prof:
        model(x).sum().backward()
    return {e.name for e in prof.events() if e.name.startswith("fsdp_graph::")}


def _replaced_and_converted(rank, world_size):
    """Shards replaced or converted after fully_shard go back into the buffer at the next gather."""
    torch.manual_seed(0)
    reference = MLPStack()
    results = {}
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(rank))

    # torchtitan: build on meta, shard, to_empty (swap_tensors), initialise in place
    with torch.device("meta"):
        meta = MLPStack()
    for block in meta.blocks:
        fully_shard(block)
    fully_shard(meta)
    meta.to_empty(device="cpu")
    values = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in meta.named_parameters():
            p.copy_(distribute_tensor(values[name].detach(), p.device_mesh, p.placements))
    results["to_empty"] = meta

    # Accelerate / HF: load_state_dict(assign=True) puts new DTensors in place
    assigned = copy.deepcopy(reference)
    for block in assigned.blocks:
        fully_shard(block)
    fully_shard(assigned)
    values = reference.state_dict()
    state = {
        k: distribute_tensor(values[k].clone(), p.device_mesh, p.placements) for k, p in assigned.named_parameters()
    }
    assigned.load_state_dict(state, assign=True)
    results["assign"] = assigned

    # model.double(): swap_tensors to another dtype rebuilds the buffer in float64
    doubled = copy.deepcopy(reference)
    for block in doubled.blocks:
        fully_shard(block)
    fully_shard(doubled)
    doubled.double()
    results["double"] = doubled

    out = {}
    for name, model in results.items():
        ops = _profiled_step(model, x.double() if name == "double" else x)
        out[name] = (_buffer_views(model), ops, {n: p.full_tensor().float() for n, p in model.named_parameters()})
    return out, {n: p.detach() for n, p in reference.named_parameters()}


def test_replaced_and_converted_shards_live_in_the_buffer_again():
    results, full = run_ranks(_replaced_and_converted, 2)
    for name, (views, ops, params) in results.items():
        assert views and all(views.values()), (name, views)
        assert "fsdp_graph::copy_in" not in ops, (name, ops)
        for param_name, value in params.items():
            assert torch.equal(value, full[param_name]), (name, param_name)


def _assigned_between_compiled_steps(rank, world_size):
    """A compiled step, then new DTensors assigned in place of the shards: the recompiled step
    gathers the new values, from the buffer again."""
    torch.manual_seed(0)
    reference = MLPStack()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(rank))
    run(x).sum().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5).add_(0.25)
    values = reference.state_dict()
    state = {
        k: distribute_tensor(values[k].clone(), p.device_mesh, p.placements) for k, p in model.named_parameters()
    }
    model.load_state_dict(state, assign=True)
    counters.clear()
    with torch.profiler.profile() as prof:
        out = run(x)
        out.sum().backward()
    ops = {e.name for e in prof.events() if e.name.startswith(("fsdp_graph::", "_c10d_functional::"))}
    return torch.equal(out, reference(x)), _buffer_views(model), ops, dict(counters["stats"])


def test_shards_assigned_between_compiled_steps_live_in_the_buffer_again():
    same, views, ops, stats = run_ranks(_assigned_between_compiled_steps, 2)
    assert same
    assert views and all(views.values()), views
    # The step after the assignment was compiled again (one graph), and that graph gathers the
    # buffers, with no copy-in.
    assert stats.get("unique_graphs") == 1, stats
    assert "_c10d_functional::all_gather_into_tensor_out" in ops and "fsdp_graph::copy_in" not in ops, ops


def _muon_steps(rank, world_size):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(12, 7, bias=False), nn.Tanh(), nn.Linear(7, 5, bias=False))
    sharded = copy.deepcopy(reference)
    fully_shard(sharded[0])
    fully_shard(sharded)
    ref_opt = torch.optim.Muon(reference.parameters(), lr=0.02)
    opt = Muon(sharded.parameters(), lr=0.02)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 12, generator=gen)
        reference(x).square().mean().backward()
        sharded(x.chunk(world_size)[rank]).square().mean().backward()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    # The next all-gather reads the buffers: the gathered weights are Muon's updated ones.
    capture = _AllGatherInputs()
    with capture, torch.no_grad():
        sharded[0].unshard()
        gathered = sharded[0].weight.detach().clone()
        sharded[0].reshard()
    return (
        _buffer_views(sharded),
        [p.full_tensor() for p in sharded.parameters()],
        [p.detach() for p in reference.parameters()],
        gathered,
        capture.inputs,
        _step_storages(sharded),
    )


def test_muon_steps_the_shards_in_their_buffer():
    views, ours, theirs, gathered, inputs, buffers = run_ranks(_muon_steps, 2)
    assert views and all(views.values()), views
    for got, expected in zip(ours, theirs):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(gathered, ours[0])
    assert inputs and all(ptr in buffers for ptr, _ in inputs)
