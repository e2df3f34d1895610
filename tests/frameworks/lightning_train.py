"""Lightning Fabric's ModelParallelStrategy training a small MLP stack for a few steps on 2 gloo
ranks; the user's `parallelize_fn` calls `fully_shard`. Prints the losses.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/frameworks/lightning_train.py \
        {torch,ours} {eager,meta_init,whole}

`meta_init`: built under `fabric.init_module(empty_init=True)`, then `to_empty` and initialised;
`whole`: `model.compile(backend=...)` in `parallelize_fn`. See docs/frameworks/lightning.md.
"""

import json
import sys

import torch
import torch.nn as nn

impl, mode = sys.argv[1:3]
if impl == "ours":
    import fsdp_graph

    fsdp_graph.use_in_place_of_torch_fsdp()

import lightning as L  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402  (the user's own import)
from torch.distributed.tensor import distribute_tensor  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)


def parallelize(model, device_mesh):
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    if mode == "whole":
        model.compile(backend=fsdp_graph.backend(compiler="aot_eager"))
    return model


strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
values = Net().state_dict()
if mode == "meta_init":
    with fabric.init_module(empty_init=True):
        model = Net()
else:
    torch.manual_seed(0)
    model = Net()
model = fabric.setup(model)
if mode == "meta_init":
    model.module.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            p.copy_(distribute_tensor(values[name], p.device_mesh, p.placements))
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
losses = []
for step in range(4):
    g = torch.Generator().manual_seed(2 * step + fabric.global_rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
if fabric.global_rank == 0:
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": type(model.module).__mro__[1].__module__}), flush=True)
