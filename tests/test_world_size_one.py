"""One rank on the shard axis: FSDP2 issues no all-gather and no reduce-scatter there (the gathered
parameter is the shard, the reduced gradient the packed one), and neither does fsdp_graph, in eager
steps or in the compiled graph. HSDP with one rank per shard group still all-reduces over replicas.
Numbers against the unsharded model on the same global batch, and collectives against torch's
`fully_shard` doing the same."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_graph
from _compile_helpers import dumped_graphs
from _harness import run_ranks
from _models import MLPStack, batch_for_step, check_grads_match, check_params_match, comm_counts, loss_fn
from fsdp_graph import fully_shard


def _shard_stack(model, shard, mesh):
    for block in model.blocks:
        shard(block, mesh=mesh)
    return shard(model, mesh=mesh)


def _graph_collectives(dump_dir) -> dict[str, list[str]]:
    graphs = dumped_graphs(dump_dir)
    return {kind: [c["op"] for c in graphs[kind]["collectives"]] for kind in ("forward", "backward")}


def _train(rank, world_size, replicas, dump_dir):
    """Train the unsharded model, ours (eager and compiled) and torch's on a (replicas, 1) mesh
    (1-D when there is one replica); return each runtime's collectives of the last step."""
    mesh_shape, names = ((replicas, 1), ("replicate", "shard")) if replicas > 1 else ((1,), ("shard",))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = MLPStack()
    reference = copy.deepcopy(model)
    ours, theirs, compiled_module = (_shard_stack(copy.deepcopy(model), shard, mesh)
                                     for shard in (fully_shard, torch_fully_shard, fully_shard))
    compiled = torch.compile(compiled_module, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir=f"{dump_dir}/rank{rank}"))
    nets = [(reference, reference), (ours, ours), (theirs, theirs), (compiled_module, compiled)]
    opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net, _ in nets]
    counts = {}
    for step in range(3):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(reference, reference(x), y).backward()
        for name, (net, run) in zip(("ours", "torch"), nets[1:3]):
            with CommDebugMode() as mode:
                loss_fn(net, run(lx), ly).backward()
            counts[name] = comm_counts(mode)
        loss_fn(compiled_module, compiled(lx), ly).backward()
        for net, _ in nets[1:]:
            check_grads_match(net, reference)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for net, _ in nets[1:]:
        check_params_match(net, reference)
    return counts, _graph_collectives(f"{dump_dir}/rank{rank}"), dict(compiled_module._fsdp_state.ctx.fallbacks)


def test_world_size_one_issues_no_collectives(tmp_path):
    counts, graph, fallbacks = run_ranks(_train, 1, 1, str(tmp_path))
    assert counts == {"ours": {}, "torch": {}}, counts
    assert graph == {"forward": [], "backward": []} and fallbacks == {}, (graph, fallbacks)


def test_hsdp_with_one_rank_per_shard_group_only_all_reduces(tmp_path):
    """Mesh (2, 1): no all-gather or reduce-scatter, one gradient all-reduce per group, as torch's."""
    counts, graph, fallbacks = run_ranks(_train, 2, 2, str(tmp_path / "dump"))
    assert counts == {"ours": {"allreduce_": 4}, "torch": {"allreduce_": 4}}, counts  # three blocks and the root
    assert graph == {"forward": [], "backward": ["all_reduce"] * 4} and fallbacks == {}, (graph, fallbacks)
