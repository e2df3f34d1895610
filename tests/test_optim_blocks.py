"""Structure-aware placement: `whole_block_placement` and the whole-block path of `WholeMatrixOptimizer`.

examples/block_polar.py's `BlockPolarSGD` (b x b blocks, each replaced by its polar factor) against an
unsharded reference written here (a loop over blocks, polar factor by SVD), with and without the
placement, on uneven matrices: the same updates either way, no bytes sent under the placement. Also a
real backward (eager and compiled) through a Llama whose SwiGLU weights the placement shards on dim 1,
HSDP on a 2 x 2 mesh, PyTorch's own `fully_shard` given the same placement, and a DCP resume that
continues bit for bit.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fsdp_graph
from _harness import run_ranks
from _optim_helpers import Matrices, full, global_grads, resume_continues_bitwise
from _models import batch_for_step, loss_fn, shard_blocks_then_root, tiny_llama
from block_polar import BlockPolarSGD
from fsdp_graph import fully_shard
from fsdp_graph.optim import whole_block_placement
from fsdp_graph.optim.owners import assign_owners

BLOCK = 4
# On 2 ranks with 4 x 4 blocks: (7, 16) and (1, 6) keep Shard(0) (cut at row 4, or no cut); (9, 8) is cut
# at row 5 under Shard(0), at column 4 under Shard(1); (3, 5) and (10, 6) have no whole-block dim.
SHAPES = [(7, 16), (9, 8), (8, 8), (3, 5), (1, 6), (10, 6)]
LR, MOMENTUM, EPS = 0.05, 0.9, 1e-8
RTOL = 1e-5


def reference_update(momentum: torch.Tensor, b: int, eps: float) -> torch.Tensor:
    """Each b x b block (the last ones shorter) to U diag(s / sqrt(s^2 + eps)) V^T, from its SVD."""
    m = momentum.double()
    out = torch.empty_like(m)
    for i in range(0, m.shape[0], b):
        for j in range(0, m.shape[1], b):
            u, s, vh = torch.linalg.svd(m[i:i + b, j:j + b], full_matrices=False)
            out[i:i + b, j:j + b] = u @ torch.diag(s / (s * s + eps).sqrt()) @ vh
    return out.float()


def whole_block_dims(shape, num_shards: int, b: int) -> list[int]:
    """The dims along which torch.chunk's pieces all start on a block edge (brute force); blocks are
    b x b on the last two dims, one entry on leading dims."""
    block = [1] * (len(shape) - 2) + [b, b]
    return [d for d in range(len(shape))
            if all(int(c[0]) % block[d] == 0 for c in torch.arange(shape[d]).chunk(num_shards))]


def test_placement_picks_the_first_dim_whose_pieces_hold_whole_blocks():
    for num_shards in (1, 2, 3, 4):
        placement = whole_block_placement((BLOCK, BLOCK), num_shards)
        for shape in [*SHAPES, (16, 12), (12, 3), (2, 9, 8), (5,)]:
            dims = whole_block_dims(shape, num_shards, BLOCK) if len(shape) > 1 else []  # 1-D: keep Shard(0)
            got = placement(nn.Parameter(torch.zeros(shape)))
            assert got == (Shard(dims[0]) if dims else None), (shape, num_shards, got)
    one_matrix = whole_block_placement(lambda s: (1,) * (len(s) - 2) + tuple(s[-2:]), 2)  # Muon's blocks
    assert one_matrix(nn.Parameter(torch.zeros(4, 7, 5))) == Shard(0)
    assert one_matrix(nn.Parameter(torch.zeros(7, 5))) is None  # no Shard(k) leaves a 2-D matrix whole
    assert one_matrix(nn.Parameter(torch.zeros(1, 5))) == Shard(0)  # one row: rank 1 holds nothing


@pytest.mark.parametrize("block, mesh, error", [
    ((0, 4), 2, ValueError), ((4, "4"), 2, ValueError), ((), 2, ValueError), ((4, 4), "2", TypeError),
    ((4, 4), 0, ValueError),
])
def test_placement_refuses_bad_arguments(block, mesh, error):
    with pytest.raises(error):
        whole_block_placement(block, mesh)


def test_placement_refuses_a_block_shape_of_the_wrong_rank():
    placement = whole_block_placement(lambda shape: (4, 4), 2)
    with pytest.raises(ValueError, match="one size per dim"):
        placement(nn.Parameter(torch.zeros(2, 8, 8)))


def crossed_runs(shape, dim: int, num_shards: int, b: int) -> list[list[int]]:
    """The b-long runs along `dim` whose entries lie on more than one of torch.chunk's pieces (brute
    force), each as its length on every shard: what travels to an owner."""
    shard_of = [s for s, c in enumerate(torch.arange(shape[dim]).chunk(num_shards)) for _ in c]
    runs = []
    for first in range(0, shape[dim], b):
        held = [shard_of[first:first + b].count(s) for s in range(num_shards)]
        if sum(1 for n in held if n) > 1:
            runs.append(held)
    return runs


def _expected_sent_bytes(opt, shapes: list, dims: list[int], num_replicas: int, num_shards: int) -> int:
    """Bytes all ranks send per step (fp32): each crossed run's parts but the owner's own to the owner
    (from the owner's replica), and the run's update back to every rank but the owner."""
    runs = []  # (shape, each shard's length along the dim, dim), in parameter order
    for shape, dim in zip(shapes, dims):
        for held in crossed_runs(shape, dim, num_shards, BLOCK):
            run_shape = list(shape)
            run_shape[dim] = sum(held)
            runs.append((run_shape, held, dim))
    owners = assign_owners([opt.matrix_cost(opt.param_groups[0], torch.Size(r[0])) for r in runs],
                           num_replicas * num_shards)
    total = 0
    for (run_shape, held, dim), owner in zip(runs, owners):
        numel = torch.Size(run_shape).numel()
        own = held[owner % num_shards] * numel // sum(held)
        total += (numel - own) + (num_replicas * numel - own)
    return 4 * total


def _against_reference(rank, world_size, mesh_shape, with_placement, shard_fn=fully_shard):
    torch.manual_seed(0)
    reference = Matrices(SHAPES)
    mesh = init_device_mesh("cpu", mesh_shape)
    num_shards = mesh_shape[-1]
    kwargs = {"shard_placement_fn": whole_block_placement((BLOCK, BLOCK), mesh)} if with_placement else {}
    sharded = shard_fn(copy.deepcopy(reference), mesh=mesh, **kwargs)
    expected_dims = [whole_block_dims(s, num_shards, BLOCK) if with_placement else [0] for s in SHAPES]
    assert [p.placements[-1] for p in sharded.parameters()] == [Shard(d[0] if d else 0) for d in expected_dims]
    opt = BlockPolarSGD(sharded.parameters(), lr=LR, momentum=MOMENTUM, block_size=BLOCK, eps=EPS)
    bufs = [torch.zeros(s) for s in SHAPES]
    # A matrix sends the runs of blocks that cuts between pieces cross (none where its placement's
    # dim holds whole blocks); its other blocks are updated where they lie.
    dims = [p.placements[-1].dim for p in sharded.parameters()]
    travelling = [bool(crossed_runs(s, d, num_shards, BLOCK)) for s, d in zip(SHAPES, dims)]
    assert travelling == [d not in whole_block_dims(s, num_shards, BLOCK) for s, d in zip(SHAPES, dims)]
    for step in range(3):
        grads = global_grads(SHAPES, step)
        for s, g in zip(sharded.weights, grads):
            s.grad = distribute_tensor(g, s.device_mesh, s.placements)
        before = [full(p) for p in sharded.parameters()]
        opt.step()
        for i, (p, b, g) in enumerate(zip(sharded.parameters(), before, grads)):
            bufs[i] = MOMENTUM * bufs[i] + g
            expected = -LR * reference_update(bufs[i], BLOCK, EPS)
            torch.testing.assert_close(full(p) - b, expected, rtol=RTOL, atol=1e-6)
        sent = torch.tensor([opt.last_step_sent_bytes])
        dist.all_reduce(sent)
        num_replicas = mesh_shape[0] if len(mesh_shape) == 2 else 1
        assert sent.item() == _expected_sent_bytes(opt, SHAPES, dims, num_replicas, num_shards)
    for p in sharded.parameters():  # momentum stays sharded like the parameter
        assert opt.state[p]["momentum_buffer"].placements == p.placements
    return travelling


@pytest.mark.parametrize("with_placement", [False, True], ids=["shard0", "whole_blocks"])
def test_block_optimizer_matches_the_unsharded_reference(with_placement):
    travelling = run_ranks(_against_reference, 2, (2,), with_placement)
    # Shard(0) sends (9, 8), (3, 5) and (10, 6); the placement keeps (9, 8) whole-blocked on dim 1.
    assert travelling == [False, not with_placement, False, True, False, True]


def test_block_optimizer_on_three_ranks_sends_only_the_crossed_runs():
    """Shard(0) on 3 ranks: pieces of 3 rows against 4-row blocks, so a piece may lie inside one
    crossed run (7x16: rows 6-7) or across two (9x8: rows 3-6), beside pieces with blocks of their own."""
    run_ranks(_against_reference, 3, (3,), False)


def test_placement_and_optimizer_on_torchs_fully_shard():
    """The same shard_placement_fn given to PyTorch's FSDP2 `fully_shard`: the same placements, and
    the optimizer on its DTensors matches the unsharded reference with the same bytes."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    travelling = run_ranks(_against_reference, 2, (2,), True, torch_fully_shard)
    assert travelling == [False, False, False, True, False, True]


def test_block_optimizer_under_the_placement_with_hsdp():
    """A 2 x 2 mesh: the placement follows the shard axis; local pieces update on both replicas, the
    travelling matrices go to owners among all 4 ranks."""
    travelling = run_ranks(_against_reference, 4, (2, 2), True)
    assert travelling == [False, False, False, True, False, True]


def _training(rank, world_size, compiled):
    """A real backward through a Llama sharded with the placement (eager or compiled); an unsharded copy
    gets the same global gradients and the reference update, AdamW on the rest on both sides."""
    torch.manual_seed(0)
    model = tiny_llama(num_layers=1)  # dim 32, SwiGLU hidden 56: w1, w3 [56, 32] are cut at row 28 under Shard(0)
    reference = copy.deepcopy(model)
    placement = whole_block_placement((8, 8), world_size)
    sharded = copy.deepcopy(model)
    shard_blocks_then_root(sharded, shard_placement_fn=placement)
    assert sharded.layers[0].feed_forward.w1.weight.placements == (Shard(1),)
    run = torch.compile(sharded, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else sharded

    def split(m):
        matrices = [p for n, p in m.named_parameters() if n.startswith("layers.") and p.ndim == 2]
        return matrices, [p for p in m.parameters() if all(p is not q for q in matrices)]

    matrices, others = split(sharded)
    opts = [BlockPolarSGD(matrices, lr=LR, momentum=MOMENTUM, block_size=8, eps=EPS), torch.optim.AdamW(others, lr=1e-2)]
    ref_matrices, ref_others = split(reference)
    ref_adamw = torch.optim.AdamW(ref_others, lr=1e-2)
    bufs = [torch.zeros_like(p) for p in ref_matrices]
    for step in range(2):
        _, _, lx, ly = batch_for_step(model, step, 4, rank, world_size)
        loss_fn(sharded, run(lx), ly).backward()
        for r, s in zip(reference.parameters(), sharded.parameters()):
            r.grad = full(s.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert opts[0].last_step_sent_bytes == 0
        ref_adamw.step()
        ref_adamw.zero_grad()
        with torch.no_grad():
            for i, p in enumerate(ref_matrices):
                bufs[i] = MOMENTUM * bufs[i] + p.grad
                p.add_(reference_update(bufs[i], 8, EPS), alpha=-LR)
                p.grad = None
        for s, r in zip(sharded.parameters(), reference.parameters()):
            torch.testing.assert_close(full(s), r.detach(), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_with_the_placement_matches_the_unsharded_reference(compiled):
    run_ranks(_training, 2, compiled)


def _resume(rank, world_size, path):
    """Train under the placement, checkpoint through DCP, resume: the same steps bit for bit."""
    def build(seed):
        torch.manual_seed(seed)
        model = fully_shard(Matrices(SHAPES), shard_placement_fn=whole_block_placement((BLOCK, BLOCK), world_size))
        return model, BlockPolarSGD(model.parameters(), lr=LR, momentum=MOMENTUM, block_size=BLOCK, eps=EPS)

    saved = resume_continues_bitwise(build, SHAPES, path)
    placements = {b["momentum_buffer"].placements for b in saved["state"].values()}
    assert placements == {(Shard(0),), (Shard(1),)}  # saved sharded, as placed


def test_dcp_resume_under_the_placement_continues_bitwise():
    with tempfile.TemporaryDirectory() as path:
        run_ranks(_resume, 2, path)
