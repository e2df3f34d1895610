"""Ranks that take different paths for one group in a compiled step: traced on one, eager on another.

Two gloo ranks. Dynamo decides per rank whether a module call is traced or runs on the eager hooks
([Note: Fallback groups keep the traced order] in traced/hooks.py), so the two paths must put the
same collectives on the wire. Each test trains the unsharded model, the eager runtime and the
compiled model on the same global batch and compares every loss, gradient and final parameter
(`train_compiled_and_compare`), and checks that the ranks really did take different paths.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import MLPBlock, MLPStack, shard_blocks_then_root
from fsdp_graph import fully_shard


class MoEStack(nn.Module):
    """Top-1 routing to experts with data-dependent row counts (each rank routes its own tokens).
    `nonzero` breaks the graph inside the experts' loop, so every expert call is a frame of its own
    and Dynamo counts cache entries per rank: with different limits the ranks diverge."""

    def __init__(self, dim: int = 13, hidden: int = 5, num_experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(num_experts))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        route = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(x.index_select(0, rows)))
        return self.head(x + out).squeeze(-1)


def _shard_experts(model: MoEStack) -> MoEStack:
    for expert in model.experts:
        fully_shard(expert)
    fully_shard(model)
    return model


def _fallbacks_per_rank(fallbacks: dict) -> list[set]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, set(fallbacks))
    return gathered


def _moe_with_per_rank_recompile_limit(rank, world_size, compiler):
    torch.manual_seed(0)
    # Rank 0 traces the experts' shared forward frame once and then runs experts on the eager
    # hooks; rank 1 traces every expert: the same group is traced on one rank and eager on the other.
    torch._dynamo.config.recompile_limit = 1 if rank == 0 else 64
    backend = fsdp_graph.backend(compiler=compiler)
    result = train_compiled_and_compare(
        MoEStack(), _shard_experts, backend, rank, world_size, steps=3, global_batch=16,
        bitwise=compiler == "aot_eager",
    )
    return _fallbacks_per_rank(result["fallbacks"])


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_expert_traced_on_one_rank_and_eager_on_the_other(compiler):
    on_rank0, on_rank1 = run_ranks(_moe_with_per_rank_recompile_limit, 2, compiler, timeout_s=400)
    experts = {f"experts.{e}" for e in range(4)}
    # Some expert ran on the eager hooks on rank 0 while rank 1 traced it.
    assert (on_rank0 - on_rank1) & experts, (on_rank0, on_rank1)


@torch.compiler.disable
def _rank0_only_helper(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


class BlockBreaksOnRank0(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.up(x))
        if dist.get_rank() == 0:  # a graph break on one rank only
            hidden = _rank0_only_helper(hidden)
        return x + self.down(hidden)


def _shard_blocks(model: MLPStack, break_on_rank0: bool = True) -> MLPStack:
    if break_on_rank0:
        model.blocks[1].__class__ = BlockBreaksOnRank0
    shard_blocks_then_root(model)
    return model


def _graph_break_on_one_rank(rank, world_size, compiler, flag, break_on_rank0):
    from fsdp_graph.compile.agreement import diverged_ranks

    torch.manual_seed(0)
    backend = fsdp_graph.backend(compiler=compiler, rank_divergent_graphs=flag)
    result = train_compiled_and_compare(
        MLPStack(num_blocks=4), lambda m: _shard_blocks(m, break_on_rank0), backend, rank, world_size,
        bitwise=compiler == "aot_eager",
    )
    detected = [None] * world_size
    dist.all_gather_object(detected, bool(diverged_ranks()))
    return list(zip(_fallbacks_per_rank(result["fallbacks"]), detected))


@pytest.mark.parametrize(
    "compiler,flag",
    [pytest.param("inductor", True, marks=pytest.mark.slow), ("aot_eager", False)],
    ids=["inductor-flag", "aot_eager-detected"],
)
def test_graph_break_on_one_rank(compiler, flag):
    """Rank 0 breaks the graph inside blocks.1, so its root and blocks.1 run on the eager hooks where
    rank 1 traces one graph of every group. With `rank_divergent_graphs=True` every graph keeps its
    groups' collectives in program order; without it, the ranks find out while compiling
    ([Note: Ranks that compile different graphs]). Before that, the ranks put different collectives
    on the wire and gloo aborted the process."""
    results = run_ranks(_graph_break_on_one_rank, 2, compiler, flag, True)
    (on_rank0, _), (on_rank1, detected1) = results
    assert "blocks.1" in on_rank0 and "blocks.1" not in on_rank1, (on_rank0, on_rank1)
    if not flag:  # rank 1 holds the graph of several groups; rank 0 compiled none to reorder
        assert detected1, results


def _batches_of_other_sizes(rank, world_size):
    import copy

    from fsdp_graph.compile import agreement

    torch.manual_seed(0)
    reference = MLPStack(num_blocks=3)
    model = _shard_blocks(copy.deepcopy(reference), break_on_rank0=False)
    decisions = []
    diverged = agreement.diverged
    agreement.diverged = lambda *a, **k: decisions.append(diverged(*a, **k)) or decisions[-1]
    compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        # First 4 rows on every rank, then rank r has 5 + 3r rows: both recompile, on other shapes.
        xs = [torch.randn(5 + 3 * r if step else 4, 13, generator=gen) for r in range(world_size)]
        # FSDP averages the ranks' gradients: the reference's loss is the mean of the ranks' losses.
        sum(reference(x).pow(2).mean() for x in xs).div(world_size).backward()
        compiled(xs[rank]).pow(2).mean().backward()
        for name, p in model.named_parameters():
            ref_grad = dict(reference.named_parameters())[name].grad
            torch.testing.assert_close(p.grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-6, msg=name)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    return decisions, bool(agreement.diverged_ranks())


def test_same_graphs_keep_the_schedule_and_a_recompile_keeps_the_wire_order():
    """The first step has the same batch size on every rank: the same graph everywhere, agreed and
    scheduled in full. Then each rank has its own batch size, and Dynamo recompiles: a graph of the
    same frame, which asks nobody and issues its collectives in the order of the first ([Note: One
    wire order per frame] in fsdp_graph/compile/agreement.py)."""
    decisions, diverged = run_ranks(_batches_of_other_sizes, 2)
    assert decisions == [False] and not diverged, (decisions, diverged)


# Each rank pads its batch to its own longest row: new lengths come on one rank at a time.
_PER_RANK_LENGTHS = ([8, 8, 8, 9, 16, 16, 7, 20, 11, 24, 13, 10], [8, 12, 12, 15, 9, 16, 21, 20, 5, 18, 13, 30])


def _per_rank_padding(rank, world_size, impl, layers=2, regions="marked"):
    """One AdamW step per length of this rank's; the losses averaged over the ranks, how many times
    this rank asked the others about a graph, and the last gradients."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from _models import shard_llama, tiny_llama
    from fsdp_graph.compile import agreement

    asked = []
    diverged = agreement.diverged
    agreement.diverged = lambda *a, **k: asked.append(1) or diverged(*a, **k)
    torch.manual_seed(0)
    model = shard_llama(tiny_llama(layers), fully_shard if impl == "ours" else torch_fully_shard)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", regions=regions)) if impl == "ours" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, length in enumerate(_PER_RANK_LENGTHS[rank]):
        tokens = torch.randint(0, 64, (2, length + 1), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = F.cross_entropy(run(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if step < len(_PER_RANK_LENGTHS[rank]) - 1:
            optimizer.step()
            optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    if impl == "ours":
        assert model._fsdp_state.ctx.fallbacks == {}, model._fsdp_state.ctx.fallbacks
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return losses, len(asked), grads


@pytest.mark.slow  # over 13 s on a 2-core machine (docs/testing.md)
def test_per_rank_padding_recompiles_on_one_rank_at_a_time_without_waiting():
    """Each rank its own lengths, whole step: a rank recompiling where the other runs its graph
    waited 30 s for an answer that never came, then kept the full schedule against the other's
    program order, and gloo aborted ("23242 vs 4134"). Bit for bit as torch's fully_shard, eager."""
    losses, asked, grads = run_ranks(_per_rank_padding, 2, "ours")
    reference, _, reference_grads = run_ranks(_per_rank_padding, 2, "torch")
    assert losses == reference
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name
    assert asked == 1  # the first graph only: the recompiles asked nobody


@pytest.mark.slow  # over 13 s on a quiet 2-core machine (docs/testing.md)
def test_per_rank_padding_with_every_block_a_region():
    """The same with `regions="blocks"` ([Note: Every block a compile region]), 3 layers (the first
    traced inline, the other two one region): each rank's recompiles make the same regions, and
    issue the first graph's wire order."""
    losses, asked, grads = run_ranks(_per_rank_padding, 2, "ours", 3, "blocks")
    reference, _, reference_grads = run_ranks(_per_rank_padding, 2, "torch", 3)
    assert losses == reference
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name
    assert asked == 1


def _per_rank_padding_inductor(rank, world_size, cache_dir, autograd_cache=True, disabled_passes=()):
    """Rank r pads to its own lengths (a recompile on rank 1 alone at step 1), whole step compiled
    with Inductor with its caches in `cache_dir`, against an unsharded reference on both ranks'
    batches. Returns how many times this rank asked the others about a graph."""
    import copy
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # ranks fork from a server started before the test
    torch._functorch.config.enable_autograd_cache = autograd_cache

    from _models import shard_llama, tiny_llama
    from fsdp_graph.compile import agreement

    asked = []
    diverged = agreement.diverged
    agreement.diverged = lambda *a, **k: asked.append(1) or diverged(*a, **k)
    torch.manual_seed(0)
    reference = tiny_llama(2)
    model = shard_llama(copy.deepcopy(reference), fully_shard)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="inductor", disabled_passes=disabled_passes))
    _steps_against_reference(rank, world_size, reference, model, run, ([8, 8, 8, 9], [8, 12, 12, 15]), batch=2)
    return len(asked)


def _steps_against_reference(rank, world_size, reference, model, run, lengths, batch, fallbacks_expected=False):
    """One AdamW step per length, rank r on `lengths[r]`, each checked against the unsharded
    `reference` on both ranks' batches: the loss averaged over the ranks and every gradient.
    Returns the groups that ran on the eager hooks inside the compiled call (none unless
    `fallbacks_expected`)."""
    import torch.nn.functional as F

    vocab = reference.tok_embeddings.num_embeddings
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(len(lengths[0])):
        tokens = [torch.randint(0, vocab, (batch, lengths[r][step] + 1), generator=torch.Generator().manual_seed(10 * step + r))
                  for r in range(world_size)]
        ref_loss = sum(F.cross_entropy(reference(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()) for t in tokens) / world_size
        ref_loss.backward()
        mine = tokens[rank]
        loss = F.cross_entropy(run(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total.item() / world_size, ref_loss.item(), rtol=1e-4, atol=1e-5)
        for name, p in model.named_parameters():
            expected = reference.get_parameter(name).grad
            torch.testing.assert_close(p.grad.full_tensor(), expected, rtol=1e-4, atol=1e-5, msg=name)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert fallbacks_expected or model._fsdp_state.ctx.fallbacks == {}, model._fsdp_state.ctx.fallbacks
    return set(model._fsdp_state.ctx.fallbacks)


@pytest.mark.slow  # Inductor compiles cold, relaunches
def test_relaunches_from_each_cache_keep_the_wire_orders_and_each_ranks_backward(tmp_path):
    """Three launches on one cache directory: cold, then from AOTAutogradCache, then without it
    from Inductor's FX graph cache (as where torchtitan's selective activation checkpointing
    bypasses AOTAutogradCache), each against the unsharded reference.
    - A relaunch's first graph comes from the caches, so none of our passes run for it: the wire
      orders its cold compile recorded are read from beside the caches ([Note: Wire orders beside
      the compile caches] in fsdp_graph/compile/agreement.py). Without them, rank 1's recompile
      asked the others again, waited 30 s, and gloo aborted ("23242 vs 4134").
    - The FX graph cache's keys are the same on every rank ([Note: Rank-independent cache keys]),
      but on gloo a backward is not: it reads this rank's row of each reduce-scatter ([Note:
      Reduce-scatters on gloo] in passes/gloo.py), so a rank that loaded the backward the other
      rank compiled trained on the other rank's gradients. Each group's reduce-scatter is its own
      here (no auto-bucketing, as torchtitan's layers are), where that pass applies."""
    cache_dir = str(tmp_path / "inductor")
    unbucketed = {"auto_bucket"}
    assert run_ranks(_per_rank_padding_inductor, 2, cache_dir, True, unbucketed) == 1  # cold: the first graph asked, the recompile did not
    assert list((tmp_path / "inductor" / "fsdp_graph" / "wire_orders").iterdir())
    assert run_ranks(_per_rank_padding_inductor, 2, cache_dir, True, unbucketed) == 1  # its first graph from the caches
    assert run_ranks(_per_rank_padding_inductor, 2, cache_dir, False, unbucketed) == 1


def _one_rank_stays_on_the_first_graph(rank, world_size, layers, lengths, backend_options=None, fallbacks_expected=False,
                                       mesh_shape=None):
    """Rank 0 keeps its first length (its first graph, static) while rank 1 takes new ones (a
    recompile, symbolic in the length), against an unsharded reference on every rank's batch
    (`lengths` per rank). `mesh_shape`: HSDP on a 2-D mesh of that shape. Returns each rank's groups
    that ran on the eager hooks inside the compiled call."""
    import copy

    from _models import Llama, LlamaConfig, shard_llama
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    reference = Llama(LlamaConfig(vocab_size=512, dim=128, num_layers=layers, num_heads=4, num_kv_heads=2, hidden_dim=344))
    mesh = {} if mesh_shape is None else {"mesh": init_device_mesh("cpu", mesh_shape)}
    model = shard_llama(copy.deepcopy(reference), fully_shard, **mesh)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", **(backend_options or {})))
    fallbacks = _steps_against_reference(rank, world_size, reference, model, run, lengths, 4, fallbacks_expected)
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, fallbacks)
    return every_rank


def _kept_under_a_budget(rank, world_size, lengths, budget):
    """`_one_rank_stays_on_the_first_graph`'s steps (4 layers, rank r on `lengths[r]`) under a
    memory budget; what unshard_selection logged on each rank, for the test to see what it kept."""
    import logging

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    selection = logging.getLogger("fsdp_graph.passes.unshard_selection")
    selection.setLevel(logging.INFO)
    selection.addHandler(handler)
    _one_rank_stays_on_the_first_graph(rank, world_size, 4, lengths, {"memory_budget_bytes": budget})
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, logged)
    return every_rank


@pytest.mark.slow  # over 13 s on a 2-core machine (docs/testing.md)
def test_a_rank_recompiling_alone_keeps_the_first_graphs_unsharded_groups():
    """Under a memory budget, rank 1 recompiles at a longer length alone while rank 0 runs the
    first graph, planned at 24 tokens, which keeps every block gathered for backward. Planned again
    at 64 tokens (larger activations), the recompile kept none and gathered all four again in its
    backward, where rank 0's backward gathers nothing: both ranks waited for ever. It now keeps
    the first graph's groups ([Note: One collective set per frame] in passes/unshard_selection.py)."""
    budget = int(7.5 * 2**20)
    logged = run_ranks(_kept_under_a_budget, 2, ([24, 24, 24], [24, 64, 128]), budget, timeout_s=120)
    kept_first = [f"fsdp_graph::unshard_selection keeps layers.{i}:" for i in (3, 2, 1, 0)]  # last block first
    assert [m[:len(k)] for m, k in zip(logged[1], kept_first)] == kept_first and logged[0] == logged[1][:4]
    assert logged[1][4:] == ["fsdp_graph::unshard_selection keeps ['layers.0', 'layers.1', 'layers.2', 'layers.3'], "
                             "as the frame's first graph does"]  # the recompile, on rank 1 only


def test_ranks_whose_first_graphs_differ_in_shape_keep_no_group_for_the_budget():
    """Each rank's first graph at its own length: planned on each rank's own sizes, the budget
    kept all four blocks gathered on rank 0 (24 tokens) and none on rank 1 (64), whose backward
    gathered them again: both ranks waited for ever. Such graphs keep program order, and leave
    the budget's selection out (`differs_from_eager` in passes/table.py)."""
    budget = int(7.5 * 2**20)
    logged = run_ranks(_kept_under_a_budget, 2, ([24, 24], [64, 64]), budget, timeout_s=120)
    assert logged == [[], []]


@pytest.mark.slow  # over 13 s on a 2-core machine (docs/testing.md)
def test_one_rank_on_its_first_graph_while_the_other_recompiles():
    """The recompiled graph, scheduled with other costs, put a re-gather after a reduce-scatter
    where the first graph issued it before; on gloo the all-gathers write a buffer of their own,
    which `order_collectives_as` took as a barrier no collective could cross, so it could not
    give the new graph the first one's order, and the two ranks waited on each other's collectives
    for ever."""
    run_ranks(_one_rank_stays_on_the_first_graph, 2, 4, ([24, 24, 24], [24, 32, 40]), timeout_s=120)


def _falls_back_at_the_recompile_limit(rank, world_size, buckets=None, mesh_shape=None):
    """Rank 1 at a recompile limit of 1, taking new lengths: it falls back at its second step; the
    other ranks stay on their first length and graph. `buckets`: "merged" has auto_bucket merge
    blocks' collectives in twos (a latency-bound link), "split" cut each bucket in pieces (a small
    cap). `mesh_shape`: HSDP on a 2-D mesh of that shape."""
    from fsdp_graph.passes.cost_model import HardwareProfile

    torch._dynamo.config.recompile_limit = 1 if rank == 1 else 8
    options = {
        None: None,
        # Each block's bucket is about 0.73 MB, the root's 0.52 MB.
        "merged": {"hardware_profile": HardwareProfile("latency-bound", 1e9, 1e9, 1e9, 0.0, 1e-3, 1e15),
                   "bucket_cap_bytes": 2_000_000},
        "split": {"bucket_cap_bytes": 300_000},
    }[buckets]
    lengths = [[24, 32, 40] if r == 1 else [24, 24, 24] for r in range(world_size)]
    return _one_rank_stays_on_the_first_graph(rank, world_size, 8, lengths, options, fallbacks_expected=True,
                                              mesh_shape=mesh_shape)


def test_a_rank_falling_back_in_a_later_step_keeps_the_graphs_wire_order():
    """Rank 1 reaches its recompile limit at its second length and runs the whole step on the eager
    hooks, while rank 0 runs its graph. At 8 layers the graph's backward gathers a block again
    before it reduce-scatters the block after it (a prefetch), where the hooks reduce-scatter first:
    both ranks waited for ever. The fallback now issues the graph's order ([Note: A fallback keeps
    the frame's wire order] in runtime/wire_plan.py), against the unsharded reference."""
    on_rank0, on_rank1 = run_ranks(_falls_back_at_the_recompile_limit, 2, timeout_s=180)
    assert on_rank0 == set() and {"<root>", "layers.0", "layers.7"} <= on_rank1, (on_rank0, on_rank1)


# split: over 7 s on a 2-core machine (docs/testing.md)
@pytest.mark.parametrize("buckets", ["merged", pytest.param("split", marks=pytest.mark.slow)])
def test_a_rank_falling_back_keeps_the_graphs_merged_and_split_buckets(buckets):
    """As above, where auto_bucket merged blocks' buckets into one collective or cut each in
    pieces: the fallback issues the same collectives ([Note: A compiled graph's buckets on the eager
    hooks] in runtime/collectives.py); before, it issued one per group and both ranks hung."""
    on_rank0, on_rank1 = run_ranks(_falls_back_at_the_recompile_limit, 2, buckets, timeout_s=180)
    assert on_rank0 == set() and {"<root>", "layers.0", "layers.7"} <= on_rank1, (on_rank0, on_rank1)


@pytest.mark.slow  # over 13 s on a quiet 2-core machine (docs/testing.md)
@pytest.mark.parametrize("buckets", [None, "split"])
def test_a_rank_falling_back_keeps_hsdps_all_reduces_in_the_graphs_order(buckets):
    """HSDP on 4 ranks (2 replicas of 2 shards), rank 1 falling back at its second length: the
    graph all-reduces each block's reduce-scattered shard over the replicas after gathering the
    next block, and the root's before block 0's, where the hooks all-reduce each group as its
    reduce-scatter ends. Ranks 1 and 3, whose all-reduces met in another order, waited for ever
    (each bucket whole) or gloo aborted ("131206 vs 65604", split buckets). The plan now holds the
    all-reduces and the fallback issues each in its turn."""
    fallbacks = run_ranks(_falls_back_at_the_recompile_limit, 4, buckets, (2, 2), timeout_s=240)
    assert [f == set() for f in fallbacks] == [True, False, True, True], fallbacks
    assert {"<root>", "layers.0", "layers.7"} <= fallbacks[1], fallbacks


def _another_model_after_a_divergence(rank, world_size):
    """The graph break on rank 0, then, in the same process group, ranks that compile the same
    graphs: every rank's decisions for the second model and whether it saw the ranks diverge."""
    _graph_break_on_one_rank(rank, world_size, "aot_eager", False, True)
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, _batches_of_other_sizes(rank, world_size))
    return every_rank


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_a_divergence_one_rank_saw_binds_every_rank():
    """Rank 1 alone compared a graph of several groups with rank 0's entry (rank 0 ran them on the
    eager hooks) and found the ranks diverged. A second model, the same graphs on both ranks, then
    kept program order on rank 1 and the full schedule on rank 0, which had never compared: gloo
    aborted ("760 vs 232"). The mark is in the log, and both keep program order, with the unsharded
    model's gradients."""
    on_rank0, on_rank1 = run_ranks(_another_model_after_a_divergence, 2)
    assert on_rank0 == on_rank1 == ([True], True), (on_rank0, on_rank1)


def _one_process_group_after_another(rank, world_size, store_path):
    """The graph break on rank 0 in one process group, then ranks that compile the same graphs in a
    second one: whether the first saw the ranks diverge, and every rank's decisions in the second
    and whether it saw them diverge. Each group has a store of its own: torch's gloo rendezvous on a store that
    kept the last group's keys hangs when one rank leaves that group later than the other (torch
    alone)."""
    stores = [dist.PrefixStore(f"group{k}", dist.FileStore(store_path, world_size)) for k in range(2)]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=stores[0], rank=rank, world_size=world_size)
    _, detected_on_rank1 = _graph_break_on_one_rank(rank, world_size, "aot_eager", False, True)[1]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=stores[1], rank=rank, world_size=world_size)
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, _batches_of_other_sizes(rank, world_size))
    return detected_on_rank1, every_rank


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_a_new_process_group_starts_a_fresh_log():
    """The peer log, and which ranks it saw diverge, are the default process group's ([Note: One
    log per process group] in runtime/peer_log.py): after the ranks diverged in one process group,
    a new one compares its first graph again and keeps the full schedule where the ranks compile
    the same graphs. Before, the divergence outlived the group, and every graph of several groups
    in the next one kept program order without asking."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        detected, (on_rank0, on_rank1) = run_ranks(_one_process_group_after_another, 2, f"{directory}/store")
    assert detected, "the first process group's ranks did not diverge"
    assert on_rank0 == on_rank1 == ([False], False), (on_rank0, on_rank1)


def test_a_log_on_a_store_that_kept_an_earlier_log_reads_none_of_its_entries():
    """A store may outlive its process group and keep the old log's keys (a FileStore on the same
    path, torchrun's store): each rank's k-th log is the same group's, and a new log reads only its
    own entries. One process, two ranks' logs on one store."""
    from fsdp_graph.runtime.peer_log import PeerLog

    store, ranks = dist.HashStore(), (0, 1)
    old = [PeerLog(store, rank) for rank in ranks]
    for rank, log in enumerate(old):
        assert log.tell(ranks, f"old entry of rank {rank}") == 0
    old[0].decide(ranks, 0, "old verdict")
    new = [PeerLog(store, rank) for rank in ranks]
    assert new[0].tell(ranks, "new entry of rank 0") == 0
    assert new[1].read(ranks, 0, 0, timeout_s=1.0) == "new entry of rank 0"
    assert new[0].read(ranks, 0, 1, timeout_s=0.01) is None  # rank 1 told nothing in the new log
    assert new[1].read(ranks, 0, "verdict", timeout_s=0.01) is None
