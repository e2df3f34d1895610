"""FSDP inside pipeline stages driven by torch's schedules, on a (pp=2, dp=2) mesh of 4 gloo ranks.

Each step's gradients and the parameters after SGD are compared with the same model, unsharded and
without pipelining, on the global batch; the collectives per step with torch's own `fully_shard`
in torch's own `PipelineStage`, driven by the same schedule.
"""

from __future__ import annotations

import copy
import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from _harness import run_ranks
from _models import MLPBlock, shard_blocks_then_root

DIM, HIDDEN, BLOCKS_PER_STAGE = 13, 5, 2  # uneven dims: padding on every shard
NUM_MICROBATCHES, LOCAL_BATCH, STEPS = 4, 8, 2


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(DIM, HIDDEN) for _ in range(BLOCKS_PER_STAGE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _batch(step: int, dp_rank: int, dp_size: int):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(dp_size * LOCAL_BATCH, DIM, generator=gen)
    y = torch.randn(dp_size * LOCAL_BATCH, DIM, generator=gen)
    mine = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
    return x, y, x[mine], y[mine]


def _train(rank, world_size, schedule_name, reshard_after_forward, library):
    from torch.distributed import pipelining

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_coordinate()
    stages_per_rank = 2 if schedule_name == "interleaved" else 1
    num_stages = 2 * stages_per_rank
    torch.manual_seed(0)
    all_stages = [Stage() for _ in range(num_stages)]
    reference = nn.Sequential(*copy.deepcopy(all_stages))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    my_indices = [pp_rank + 2 * i for i in range(stages_per_rank)]  # stage i lives on pp rank i % 2

    if library == "torch":
        from torch.distributed.fsdp import fully_shard
        stage_class = pipelining.PipelineStage
    else:
        from fsdp_graph import fully_shard
        from fsdp_graph.api.pipelining import PipelineStage as stage_class
    stages, modules = [], []
    for index in my_indices:
        module = all_stages[index]
        shard_blocks_then_root(module, fully_shard, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        modules.append(module)
        stages.append(stage_class(module, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)

    def loss_fn(output, target):
        return F.mse_loss(output, target)

    if schedule_name == "interleaved":
        schedule = pipelining.ScheduleInterleaved1F1B(stages, NUM_MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = pipelining.Schedule1F1B(stages[0], NUM_MICROBATCHES, loss_fn=loss_fn)

    counts = []
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counting(fn, key):
        def counted(*args, **kwargs):
            counts[-1][key] += 1
            return fn(*args, **kwargs)
        return counted

    for step in range(STEPS):
        x, y, local_x, local_y = _batch(step, dp_rank, 2)
        counts.append({"all_gather": 0, "reduce_scatter": 0})
        with unittest.mock.patch.object(dist, "all_gather_single", counting(all_gather, "all_gather")), \
                unittest.mock.patch.object(dist, "reduce_scatter_single", counting(reduce_scatter, "reduce_scatter")):
            kwargs = {}
            if 0 in my_indices:
                kwargs["x"] = local_x  # the first stage takes the inputs
            if num_stages - 1 in my_indices:
                kwargs["target"] = local_y
            schedule.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
        if library == "ours":
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            for index, module in zip(my_indices, modules):
                for (name, param), ref_param in zip(module.named_parameters(), reference[index].parameters()):
                    torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"step {step} stage {index} {name}: {m}")
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    if library == "ours":
        for index, module in zip(my_indices, modules):
            for param, ref_param in zip(module.parameters(), reference[index].parameters()):
                torch.testing.assert_close(param.full_tensor(), ref_param, rtol=1e-5, atol=1e-6)
    return counts


@pytest.mark.parametrize("schedule_name", ["1f1b", "interleaved"])
def test_pipeline_schedule_matches_unpipelined_model(schedule_name):
    """Gradients and parameters match the unpipelined, unsharded model; with reshard_after_forward
    False each group is gathered once and reduced once per step, like torch's fully_shard."""
    counts = run_ranks(_train, 4, schedule_name, False, "ours")
    torch_counts = run_ranks(_train, 4, schedule_name, False, "torch")
    groups_per_rank = BLOCKS_PER_STAGE * (2 if schedule_name == "interleaved" else 1)  # stage roots own none
    ours = counts[-1]
    assert ours == {"all_gather": groups_per_rank, "reduce_scatter": groups_per_rank}, counts
    assert counts == torch_counts, (counts, torch_counts)


def test_pipeline_reshard_after_forward_regathers_like_torch():
    """With reshard_after_forward=True the blocks gather per micro-batch, as many times as torch's."""
    counts = run_ranks(_train, 4, "1f1b", True, "ours")
    torch_counts = run_ranks(_train, 4, "1f1b", True, "torch")
    assert counts == torch_counts, (counts, torch_counts)
    assert counts[-1]["reduce_scatter"] == BLOCKS_PER_STAGE, counts
