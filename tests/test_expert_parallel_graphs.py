"""Expert parallelism's graphs on a fake world (one process, no data moved): what the step's graphs
hold for a MoE model sharded with FSDP x EP, and what `overlap_all_to_alls` (passes/ep_overlap.py)
does to them, against the same graphs with the pass disabled."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_graph import fully_shard, run_in_chunks
from fsdp_graph.passes.cost_model import CostModel
from fsdp_graph.passes.nodes import PASS_META, chunk_of, is_all_to_all, is_collective, parallelism_of, wait_of
from fsdp_graph.inspect.timeline import timeline_svg
from fsdp_graph.predict import capture_graphs, fake_world, predict_step, schedule_graphs

DIM, HIDDEN, EXPERTS, TOKENS, WORLD, EP = 512, 1024, 8, 2048, 4, 2


class _MoE(nn.Module):
    """Token t to expert t % EXPERTS, over the "ep" ranks and back (all-to-all dispatch and combine),
    then a shared expert on every token, as DeepSeek-V3's MoE layer computes them in torchtitan."""

    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.ep_mesh = ep_mesh
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN))
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM))
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.SiLU(), nn.Linear(HIDDEN, DIM, bias=False))

    def forward(self, x):
        group, ep, tokens = self.ep_mesh.get_group(), self.ep_mesh.size(), x.shape[0]
        routed = x.view(tokens // EXPERTS, EXPERTS, DIM).transpose(0, 1).contiguous()
        received = funcol.all_to_all_single_autograd(routed, None, None, group)
        local = received.view(ep, EXPERTS // ep, -1, DIM).transpose(0, 1).reshape(EXPERTS // ep, -1, DIM)
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        out = torch.bmm(torch.relu(torch.bmm(local, w1)), w2)
        out = out.view(EXPERTS // ep, ep, -1, DIM).transpose(0, 1).reshape(EXPERTS, -1, DIM).contiguous()
        out = funcol.all_to_all_single_autograd(out, None, None, group)
        return x + out.transpose(0, 1).reshape(tokens, DIM) + self.shared(x)


class _Model(nn.Module):
    def __init__(self, ep_mesh, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MoE(ep_mesh) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _sharded_on_fake_world(layers: int = 2, chunks: int = 1) -> _Model:
    """The model on meta, its experts over ep 2 and their weights over the efsdp 2 ranks left, the
    rest over all 4 (torchtitan's dp_shard 4 x ep 2). Inside `fake_world(WORLD)`. `chunks`: each
    layer runs on that many slices of its tokens (`run_in_chunks`)."""
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    sparse = world._unflatten(0, (WORLD // EP, EP), ("efsdp", "ep"))
    with torch.device("meta"):
        model = _Model(sparse["ep"], layers)
    efsdp = FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0)
    for layer in model.layers:
        for name in ("w1", "w2"):
            setattr(layer, name, nn.Parameter(distribute_tensor(getattr(layer, name).detach(), sparse["ep"], [Shard(0)])))
        experts = {layer.w1, layer.w2}
        run_in_chunks(layer, chunks)
        fully_shard(layer, mesh=world, shard_placement_fn=lambda p, experts=experts: (
            ShardPlacementResult(placement=Shard(0), mesh_info=efsdp) if p in experts else None))
    fully_shard(model, mesh=world)
    return model


def test_all_to_alls_are_waited_on_where_their_tokens_are_read():
    """The step's graphs hold both meshes' FSDP collectives and the all-to-alls; with the pass, the
    combine's wait moves below the shared expert, every node still after its inputs and every
    process group's collectives in the traced order, and the simulator sees less exposed all-to-all
    time and a shorter step (an FSDP prefetch may lose some of the work that hid it)."""
    cost_model = CostModel("h100-infiniband")
    with fake_world(WORLD):
        graphs = capture_graphs(_sharded_on_fake_world(), torch.randn(TOKENS, DIM, device="meta"))
        without = schedule_graphs(graphs, hardware_profile=cost_model, disabled_passes={"overlap_all_to_alls"})
        scheduled = schedule_graphs(graphs, hardware_profile=cost_model)
        predictions = {name: predict_step(g, cost_model) for name, g in (("without", without), ("with", scheduled))}
    for kind, gm in scheduled.items():
        nodes = list(gm.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        assert all(position[a] < position[n] for n in nodes for a in n.all_input_nodes), kind
        # 2 layers x (dispatch, combine); the backward needs no gradient of the first dispatch's input
        assert sum(map(is_all_to_all, nodes)) == (4 if kind == "forward" else 3), kind
        for stream in {parallelism_of(n) for n in nodes if is_collective(n)}:
            issued = [[n.name for n in g.graph.nodes if is_collective(n) and parallelism_of(n) == stream]
                      for g in (without[kind], gm)]
            assert issued[0] == issued[1], (kind, stream)
        spans = [(position[n], position[wait_of(n)]) for n in nodes if is_all_to_all(n)]
        moved = [position[n] for n in nodes if n.meta.get(PASS_META) == "overlap_all_to_alls"]
        assert moved and all(any(a < i < w for a, w in spans) for i in moved), kind
    forward = list(scheduled["forward"].graph.nodes)
    combine = [n for n in forward if is_all_to_all(n)][1]
    between = forward[forward.index(combine):forward.index(wait_of(combine))]
    assert sum(n.target is torch.ops.aten.mm.default for n in between) == 2, between  # the shared expert's
    ep_exposed = {name: p.exposed_s_by.get("ep", 0.0) for name, p in predictions.items()}
    assert ep_exposed["with"] < ep_exposed["without"], ep_exposed
    steps = {name: p.step_s for name, p in predictions.items()}
    assert steps["with"] < steps["without"], steps
    # The inspector's timeline draws the all-to-alls in a lane of their own (it raised a KeyError on them).
    svg = timeline_svg(predictions["with"].simulations)
    assert "ep collectives" in svg and "all-to-all" in svg


def test_the_slices_of_a_moe_layer_send_their_tokens_in_pairs():
    """Each layer on two slices of its tokens: the pass issues slice 1's dispatch before slice 0's
    experts and slice 0's combine before slice 1's experts (in backward, where autograd has slice 1
    first, the other way round), so each slice's experts run while the other's tokens travel: less
    all-to-all time exposed, a shorter step than the same graphs without the pass."""
    cost_model = CostModel("h100-infiniband")
    with fake_world(WORLD):
        graphs = capture_graphs(_sharded_on_fake_world(chunks=2), torch.randn(TOKENS, DIM, device="meta"))
        without = schedule_graphs(graphs, hardware_profile=cost_model, disabled_passes={"overlap_all_to_alls"})
        scheduled = schedule_graphs(graphs, hardware_profile=cost_model)
        predictions = {name: predict_step(g, cost_model) for name, g in (("without", without), ("with", scheduled))}
    # Forward: 2 layers x (dispatch, combine) per slice; backward: their gradients, but for the
    # first layer's dispatch, whose input needs none.
    for kind, first, traced_order in (("forward", 0, [0, 0, 1, 1] * 2), ("backward", 1, [1, 1, 0, 0, 1, 0])):
        nodes = list(scheduled[kind].graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        assert all(position[a] < position[n] for n in nodes for a in n.all_input_nodes), kind
        assert [chunk_of(n) for n in without[kind].graph.nodes if is_all_to_all(n)] == traced_order, kind
        exchanges = [n for n in nodes if is_all_to_all(n)]
        assert [chunk_of(n) for n in exchanges] == [first, 1 - first] * (len(traced_order) // 2), kind

        def experts_under(exchange):
            """The slices whose experts (bmms) run between `exchange` and its wait."""
            between = nodes[position[exchange]:position[wait_of(exchange)]]
            return {chunk_of(n) for n in between if n.target is torch.ops.aten.bmm.default}

        # Where a layer has two pairs: the first slice's experts run while the second slice's
        # first all-to-all travels, the second slice's while the first slice's second one does.
        for _, second, third, _ in (exchanges[i:i + 4] for i in range(0, len(exchanges) - 3, 4)):
            assert experts_under(second) == {first} and experts_under(third) == {1 - first}, kind
    ep_exposed = {name: p.exposed_s_by.get("ep", 0.0) for name, p in predictions.items()}
    assert ep_exposed["with"] < 0.5 * ep_exposed["without"], ep_exposed
    steps = {name: p.step_s for name, p in predictions.items()}
    assert steps["with"] < steps["without"], steps
