"""fsdp_graph.optim.Muon against torch.optim.Muon on an unsharded copy fed the same global gradients.

Uneven matrices (7x5 and 1x6 on 2 and 3 ranks, 9x2), every hyperparameter variant, HSDP on 4 ranks,
3-D expert stacks against torch on each expert, a real backward (eager and compiled), refusals, the
owner plan's balance, the bytes moved, and a DCP resume that continues bit for bit.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp_graph
from _harness import run_ranks
from _optim_helpers import Matrices, full, global_grads, resume_continues_bitwise
from _models import MLPStack, batch_for_step, loss_fn
from fsdp_graph import fully_shard
from fsdp_graph.optim import Muon, WholeMatrixOptimizer, local
from fsdp_graph.optim.owners import assign_owners, chunk_sizes

SHAPES = [(7, 5), (5, 7), (16, 12), (3, 9), (1, 6), (12, 12), (9, 2)]
VARIANTS = [
    {},  # torch's defaults: nesterov, weight_decay 0.1, adjust_lr_fn None
    {"lr": 0.02, "nesterov": False, "weight_decay": 0.0, "adjust_lr_fn": "original"},
    {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3},
    {"lr": torch.tensor(0.03), "eps": 1e-5, "ns_coefficients": (3.0, -3.2, 1.2)},
]
NO_GRAD = (2, 1)  # (step, matrix): that matrix gets no gradient that step, so both optimizers skip it
RTOL = 1e-5  # per step, relative Frobenius error of each matrix's update


class CountingMuon(Muon):
    """Muon counting the matrices whose Newton-Schulz this rank ran (through the documented hook)."""

    num_updated = 0

    def whole_matrix_update(self, group, matrices):
        self.num_updated += len(matrices)
        return super().whole_matrix_update(group, matrices)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _step_both(reference, ref_opt, sharded, opt) -> float:
    """One step of each optimizer; the largest relative error of a sharded update against torch's."""
    before = [full(p) for p in sharded.parameters()]
    ref_before = [p.detach().clone() for p in reference.parameters()]
    ref_opt.step()
    opt.step()
    worst = 0.0
    for p, r, b, rb in zip(sharded.parameters(), reference.parameters(), before, ref_before):
        worst = max(worst, _rel_error(full(p) - b, r.detach() - rb))
        torch.testing.assert_close(full(p), r.detach(), rtol=RTOL, atol=1e-6)
    return worst


def _on_one_shard(shape, num_shards: int) -> bool:
    """Whether one shard holds every row (e.g. 1x6 on 2 ranks): then that rank holds the whole matrix
    and updates it in place (once per replica), with no bytes sent."""
    return len(torch.arange(shape[0]).chunk(num_shards)) == 1


def _expected_sent_bytes(opt: Muon, shapes: list, num_replicas: int, num_shards: int) -> int:
    """Bytes all ranks send per step (bfloat16): every piece but the owner's own to the owner, then
    every rank but the owner its piece of the update; nothing for matrices on one shard."""
    group = opt.param_groups[0]
    shapes = [s for s in shapes if not _on_one_shard(s, num_shards)]
    owners = assign_owners([opt.matrix_cost(group, torch.Size(s)) for s in shapes], num_replicas * num_shards)
    total = 0
    for shape, owner in zip(shapes, owners):
        numel = torch.Size(shape).numel()
        own = chunk_sizes(shape[0], num_shards)[owner % num_shards] * numel // shape[0]
        total += (numel - own) + (num_replicas * numel - own)
    return 2 * total


def _against_torch(rank, world_size, mesh_shape, variants, steps=4):
    worst = 0.0
    for kwargs in variants:
        torch.manual_seed(0)
        reference = Matrices(SHAPES)
        sharded = fully_shard(copy.deepcopy(reference), mesh=init_device_mesh("cpu", mesh_shape))
        ref_opt = torch.optim.Muon(reference.parameters(), **kwargs)
        opt = CountingMuon(sharded.parameters(), **kwargs)
        num_updated = 0
        for step in range(steps):
            with_grad = [i for i in range(len(SHAPES)) if (step, i) != NO_GRAD]
            for i, (r, s, g) in enumerate(zip(reference.weights, sharded.weights, global_grads(SHAPES, step))):
                r.grad = g.clone() if i in with_grad else None
                s.grad = distribute_tensor(g, s.device_mesh, s.placements) if i in with_grad else None
            worst = max(worst, _step_both(reference, ref_opt, sharded, opt))
            sent = torch.tensor([opt.last_step_sent_bytes])
            dist.all_reduce(sent)
            num_replicas = mesh_shape[0] if len(mesh_shape) == 2 else 1
            assert sent.item() == _expected_sent_bytes(opt, [SHAPES[i] for i in with_grad], num_replicas, mesh_shape[-1])
            num_updated += sum(num_replicas if _on_one_shard(SHAPES[i], mesh_shape[-1]) else 1 for i in with_grad)
        # Each matrix's Newton-Schulz ran once in the world per step (once per replica where one shard holds it).
        count = torch.tensor([opt.num_updated])
        dist.all_reduce(count)
        assert count.item() == num_updated, count
        for p in sharded.parameters():  # momentum stays sharded like the parameter
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == p.placements
            assert buf.to_local().shape == p.to_local().shape
    assert worst <= RTOL, worst
    return worst


def test_same_updates_as_torch_on_one_rank():
    run_ranks(_against_torch, 1, (1,), VARIANTS[:1])


def test_same_updates_as_torch_on_two_ranks():
    run_ranks(_against_torch, 2, (2,), VARIANTS)


def test_same_updates_as_torch_on_three_ranks():
    run_ranks(_against_torch, 3, (3,), VARIANTS[1:])


def test_same_updates_as_torch_with_hsdp():
    run_ranks(_against_torch, 4, (2, 2), VARIANTS[:2])


def _experts(rank, world_size, shard_dim):
    """3-D stacks [E, M, N], sharded on `shard_dim`, against torch.optim.Muon on each [M, N] expert."""
    shapes = [(3, 7, 5), (5, 4, 6), (2, 3, 3), (1, 4, 4)]  # (1, 4, 4): rank 1 holds no expert under Shard(0)
    torch.manual_seed(0)
    model = Matrices(shapes)
    reference = [nn.Parameter(w.detach()[e].clone()) for w in model.weights for e in range(w.shape[0])]
    sharded = fully_shard(model, shard_placement_fn=lambda p: Shard(shard_dim))
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    ref_opt = torch.optim.Muon(reference, **kwargs)
    opt = Muon(sharded.parameters(), **kwargs)
    for step in range(3):
        grads = global_grads(shapes, step)
        for s, g in zip(sharded.weights, grads):
            s.grad = distribute_tensor(g, s.device_mesh, s.placements)
        for r, g in zip(reference, [g[e] for g in grads for e in range(g.shape[0])]):
            r.grad = g.clone()
        before = [full(p) for p in sharded.parameters()]
        ref_before = [r.detach().clone() for r in reference]
        ref_opt.step()
        opt.step()
        updates = [(full(p) - b)[e] for p, b in zip(sharded.parameters(), before) for e in range(b.shape[0])]
        for got, r, rb in zip(updates, reference, ref_before):
            assert _rel_error(got, r.detach() - rb) <= RTOL
        if shard_dim == 0:  # each rank holds whole experts and updates them where they lie
            assert opt.last_step_sent_bytes == 0, opt.last_step_sent_bytes
        else:
            assert opt.last_step_sent_bytes > 0


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_expert_stacks_update_each_expert_as_torch(shard_dim):
    run_ranks(_experts, 2, shard_dim)


def _training(rank, world_size, compiled):
    """A real backward through the sharded model (eager or compiled); the unsharded copy gets the
    same global gradients, Muon for matrices and AdamW for the rest on both sides."""
    torch.manual_seed(0)
    model = MLPStack()
    reference = copy.deepcopy(model)
    sharded = fully_shard(copy.deepcopy(model))
    run = torch.compile(sharded, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else sharded

    def optimizers(m, muon_cls):
        matrices = [p for p in m.parameters() if p.ndim == 2]
        others = [p for p in m.parameters() if p.ndim != 2]
        return muon_cls(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-2)

    ref_opts, opts = optimizers(reference, torch.optim.Muon), optimizers(sharded, Muon)
    worst = 0.0
    for step in range(4):
        _, _, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(sharded, run(lx), ly).backward()
        for r, s in zip(reference.parameters(), sharded.parameters()):
            r.grad = full(s.grad)
        ref_opts[1].step()
        opts[1].step()
        worst = max(worst, _step_both(reference, ref_opts[0], sharded, opts[0]))
        for o in (*ref_opts, *opts):
            o.zero_grad()
    assert worst <= RTOL, worst


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_matches_torch_on_the_same_gradients(compiled):
    run_ranks(_training, 2, compiled)


@pytest.mark.parametrize("shape", [(6,), (2, 3, 4, 5), ()])
def test_refuses_what_torch_refuses(shape):
    """Non-matrix parameters are refused with torch's exception type (3-D stacks are our extension)."""
    with pytest.raises(ValueError):
        torch.optim.Muon([nn.Parameter(torch.randn(shape))])
    with pytest.raises(ValueError, match="Muon updates 2-D parameters"):
        Muon([nn.Parameter(torch.randn(shape))])


@pytest.mark.parametrize("kwargs", [{"lr": -1.0}, {"momentum": -0.1}, {"weight_decay": -1.0},
                                    {"adjust_lr_fn": "sqrt"}, {"lr": torch.tensor([1e-3, 1e-3])}])
def test_refuses_bad_hyperparameters_as_torch(kwargs):
    params = [nn.Parameter(torch.randn(4, 3))]
    with pytest.raises(ValueError):
        torch.optim.Muon(params, **kwargs)
    with pytest.raises(ValueError):
        Muon(params, **kwargs)


def test_owner_plan_keeps_every_rank_within_its_share_plus_one_matrix():
    gen = torch.Generator().manual_seed(0)
    for num_ranks in (1, 2, 3, 4, 8):
        costs = torch.randint(1, 10_000, (37,), generator=gen).tolist()
        owners = assign_owners(costs, num_ranks)
        assert owners == assign_owners(costs, num_ranks)  # every rank computes the same plan
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(num_ranks)]
        assert max(loads) <= sum(costs) / num_ranks + max(costs)
    assert chunk_sizes(7, 2) == [4, 3] and chunk_sizes(1, 2) == [1, 0] and chunk_sizes(5, 4) == [2, 2, 1, 0]


class NormalizedSGD(WholeMatrixOptimizer):
    """Another whole-matrix optimizer on the hook: W <- W - lr * G / |G|_F (the whole matrix's norm).
    Odd-numbered parameters travel in bfloat16, the others in fp32: one all-to-all carries both."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.narrow = {id(p) for g in self.param_groups for p in g["params"][1::2]}

    def transport_dtype(self, group, param):
        return torch.bfloat16 if id(param) in self.narrow else torch.float32

    def prepare(self, group, param, state):
        return local(param.grad)

    def whole_matrix_update(self, group, matrices):
        return [m / m.float().norm() for m in matrices]

    def apply_update(self, group, param, update):
        local(param).add_(update, alpha=-group["lr"])


def _hook(rank, world_size):
    torch.manual_seed(0)
    reference = Matrices(SHAPES)
    sharded = fully_shard(copy.deepcopy(reference))
    opt = NormalizedSGD(sharded.parameters(), lr=0.1)
    for step in range(2):
        grads = global_grads(SHAPES, step)
        for i, (r, s, g) in enumerate(zip(reference.weights, sharded.weights, grads)):
            s.grad = distribute_tensor(g, s.device_mesh, s.placements)
            g = g.bfloat16() if i % 2 else g
            with torch.no_grad():
                r.add_(g / g.float().norm(), alpha=-0.1)
        opt.step()
        for s, r in zip(sharded.parameters(), reference.parameters()):
            assert torch.equal(full(s), r.detach())


def test_another_optimizer_reuses_the_owner_machinery():
    run_ranks(_hook, 2)


def _resume(rank, world_size, path):
    """Train, checkpoint through DCP, resume: the same steps bit for bit."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1}

    def build(seed):
        torch.manual_seed(seed)
        model = fully_shard(Matrices(SHAPES))
        return model, Muon(model.parameters(), **kwargs)

    saved = resume_continues_bitwise(build, SHAPES, path)
    bufs = [v["momentum_buffer"] for v in saved["state"].values()]
    assert len(bufs) == len(SHAPES) and all(isinstance(b, DTensor) for b in bufs)  # saved sharded


def test_dcp_resume_continues_bitwise():
    with tempfile.TemporaryDirectory() as path:
        run_ranks(_resume, 2, path)


def _llama_example(rank, world_size, compiled):
    """examples/train_llama.py's model and optimizers (`--muon`): sharded, each rank its half of the
    global batch; the unsharded model with torch's Muon and AdamW on the whole batch, loss for loss."""
    from llama import Llama, LlamaConfig, shard_llama
    from train_llama import make_optimizers, synthetic_batch

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, num_layers=2, num_heads=4, hidden_dim=64, max_seq_len=16)
    reference = Llama(cfg)
    model = shard_llama(copy.deepcopy(reference), fully_shard)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else model
    ref_opts, opts = make_optimizers(reference, 3e-3, torch.optim.Muon), make_optimizers(model, 3e-3, Muon)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(4):
        tokens = synthetic_batch(cfg, 4 * world_size, 12, gen, "cpu")  # the global batch, on every rank
        local = tokens.chunk(world_size)[rank]
        loss = F.cross_entropy(run(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        ref_loss.backward()
        for opt in (*opts, *ref_opts):
            opt.step()
            opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
        ref_losses.append(ref_loss.item())
    worst = max(_rel_error(full(p), r.detach()) for p, r in zip(model.parameters(), reference.parameters()))
    return losses, ref_losses, worst


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_llama_example_with_muon_trains_loss_for_loss_with_the_unsharded_run(compiled):
    losses, ref_losses, worst = run_ranks(_llama_example, 2, compiled)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    assert losses[-1] < losses[0]
    # The gradients differ in their last fp32 bits (reduce-scatter vs one batch), and Newton-Schulz
    # runs in bfloat16 (as torch's), which can round those apart: parameters agree to bf16's scale.
    # Fed the same gradients, the updates are equal (test_training_matches_torch_on_the_same_gradients).
    assert worst <= 5e-3, worst
