"""`fully_shard(..., dp_mesh_dims=...)` on parameters that are DTensors on a whole SPMD mesh
(torchtitan's `full_dtensor` backend), against torch's `fully_shard` with the same arguments: 2 gloo
ranks on a ("dp",) mesh, and 4 on ("dp", "tp") with tensor parallelism on the other axis.
See [Note: Parameters on the whole SPMD mesh] in runtime/tp_layout.py."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map

import fsdp_graph
from _harness import run_ranks
from fsdp_graph import DataParallelMeshDims, fully_shard


class _MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _LocalEmbedding(nn.Embedding):
    """An embedding computed on local tensors (`local_map`), its weight's gradient declared
    `Replicate()` on every axis although it is each rank's partial sum (as torchtitan's is)."""

    def forward(self, tokens):
        weight = self.weight
        placements = tuple(weight.placements)
        embed = local_map(
            lambda w, t: nn.functional.embedding(t, w),
            out_placements=((tokens.placements[0],) + placements[1:],),
            in_placements=(placements, tokens.placements),
            in_grad_placements=(placements, tokens.placements),
            device_mesh=weight.device_mesh,
        )
        return embed(weight, tokens)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.local_embed = _LocalEmbedding(16, 8)
        self.blocks = nn.ModuleList(_MLP() for _ in range(2))
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.local_embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _placements(name: str, tp: bool) -> tuple:
    """Column-parallel up, row-parallel down (on "tp"); everything Replicate on "dp"."""
    if not tp:
        return (Replicate(),)
    if name.endswith("up.weight"):
        return (Replicate(), Shard(0))
    if name.endswith("down.weight"):
        return (Replicate(), Shard(1))
    return (Replicate(), Replicate())


def _spmd_model(mesh, tp: bool) -> _Stack:
    torch.manual_seed(0)
    model = _Stack()
    for name, module in list(model.named_modules()):
        for attr, p in list(module.named_parameters(recurse=False)):
            full = f"{name}.{attr}" if name else attr
            setattr(module, attr, nn.Parameter(distribute_tensor(p.detach(), mesh, _placements(full, tp))))
    return model


def _train(rank, world_size, tp, compiler):
    shape, names = ((2, 2), ("dp", "tp")) if tp else ((2,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    results = {}
    for name, fs, dims in (
        ("torch", torch_fully_shard, TorchDataParallelMeshDims(shard="dp")),
        ("ours", fully_shard, DataParallelMeshDims(shard="dp")),
    ):
        model = _spmd_model(mesh, tp)
        for block in model.blocks:
            fs(block, mesh=mesh, dp_mesh_dims=dims)
        fs(model, mesh=mesh, dp_mesh_dims=dims)
        run = model if name == "torch" or compiler is None else torch.compile(
            model, backend=fsdp_graph.backend(compiler=compiler)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(3):
            dp_rank = mesh.get_local_rank(0)
            local = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(step))[dp_rank * 4 : (dp_rank + 1) * 4]
            x = DTensor.from_local(local, mesh, (Shard(0),) + (Replicate(),) * (mesh.ndim - 1), run_check=False)
            loss = run(x).pow(2).mean()
            loss.backward()
            losses.append(loss.full_tensor().item())
            grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        if run is not model:
            assert model._fsdp_state.ctx.fallbacks == {}, model._fsdp_state.ctx.fallbacks  # traced, not eager
        results[name] = (
            losses, grads, {n: (str(p.device_mesh.mesh_dim_names), p.placements) for n, p in model.named_parameters()}
        )
    return results


@pytest.mark.parametrize(
    "tp, compiler",
    [(False, None), (False, "aot_eager"), (True, None), (True, "aot_eager")],
    ids=["dp-eager", "dp-compiled", "dp-tp-eager", "dp-tp-compiled"],
)
def test_dp_mesh_dims_trains_as_torch(tp, compiler):
    results = run_ranks(_train, 4 if tp else 2, tp, compiler)
    (our_losses, our_grads, our_layout), (losses, grads, layout) = results["ours"], results["torch"]
    assert our_layout == layout  # the same mesh and placements (Shard, or _StridedShard under tp)
    assert len(set(losses)) == len(losses)  # it trains
    assert our_losses == losses  # eager and aot_eager: bit for bit
    for step, (ours, theirs) in enumerate(zip(our_grads, grads)):
        for n, grad in theirs.items():
            assert torch.equal(ours[n], grad), f"step {step} {n}: {(ours[n] - grad).abs().max()}"


def _refusals(rank, world_size):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    messages = []
    for dims, model in (
        (DataParallelMeshDims(shard="nope"), _spmd_model(mesh, tp=False)),
        (DataParallelMeshDims(replicate="dp"), _spmd_model(mesh, tp=False)),
        (DataParallelMeshDims(shard="dp"), _Stack()),  # plain parameters
    ):
        try:
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_dp_mesh_dims_refusals_name_the_fix():
    unknown, no_shard, plain = run_ranks(_refusals, 2)
    assert "'nope'" in unknown and "('dp',)" in unknown
    assert "shard=" in no_shard
    assert "'head.weight' is a plain" in plain and "distribute_module" in plain
