"""FSDP2's `FSDPModule` controls (issue #18), each against torch's own `fully_shard` doing the same.

Several checks share one spawn of ranks to keep the suite fast.
"""

import contextlib
import copy
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_graph.runtime.collectives as collectives
from _harness import run_ranks, run_process
from _models import comm_counts, MLPBlock, shard_blocks_then_root
from fsdp_graph import AllGather, CPUOffloadPolicy, MixedPrecisionPolicy, ReduceScatter, fully_shard, share_comm_ctx


class Net(nn.Module):
    """An embedding (its backward reads no parameter), MLP blocks, a head; `fail` makes block 1 raise."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(MLPBlock(8, 6), MLPBlock(8, 6), MLPBlock(8, 6))
        self.head = nn.Linear(8, 1)
        self.fail = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).mean(1)
        x = self.blocks[0](x)
        if self.fail:
            raise RuntimeError("user error in forward")
        x = self.blocks[1:](x)
        return self.head(x).sum(-1)  # not a view: torch warns about views returned by a root


class HalfUsed(nn.Module):
    """A block whose `down` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


class Routed(nn.Module):
    """Groups that run or not per step (`mode`), one whose output is detached, a root parameter never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = HalfUsed()
        self.b = MLPBlock(4, 6)
        self.c = MLPBlock(4, 6)
        self.head = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        y = self.a(x)
        if mode == "b":
            y = self.b(y)
        if mode == "detached c":
            y = y + self.c(y).detach()
        return self.head(y).sum()


def _train_routed(fs, rank, reduce_scatter_unused_params, compile_with=None, modes=("b", "b", "detached c")):
    """AdamW steps of a sharded `Routed`, one per mode; the gradients of every step and the final
    parameters."""
    torch.manual_seed(0)
    model = Routed()
    for block in (model.a, model.b, model.c):
        fs(block)
    fs(model)
    model.set_reduce_scatter_unused_params(reduce_scatter_unused_params)
    return _adamw_steps(model, compile_with, rank, modes)


def _adamw_steps(model, compile_with, rank, step_args):
    """AdamW steps of `model` (compiled with `compile_with`, if given) on (3, 4) inputs, one per
    entry of `step_args`, the model's second argument; `.grad` kept after the second step, so that
    the third accumulates into it. The gradients of every step and the final parameters."""
    run = torch.compile(model, backend=compile_with) if compile_with is not None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    grads = []
    for step, arg in enumerate(step_args):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        run(x, arg).backward()
        grads.append({n: None if p.grad is None else p.grad.to_local().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=step != 1)
    return grads, {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _assert_same_routed(ours, theirs, what):
    for step, (got, expected) in enumerate(zip(ours[0], theirs[0])):
        assert {n for n, g in got.items() if g is None} == {n for n, g in expected.items() if g is None}, (what, step)
        for name, g in got.items():
            if g is not None:
                torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{what} step {step} {name}: {m}")
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} parameters: {m}")


class ChunkedHead(nn.Module):
    """torchtitan's chunked loss: the model's call stops before the head, which runs per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8, bias=False)
        self.norm = nn.RMSNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _train_chunked(fs, rank, grouped, compile_with=None, steps=2):
    """Adam steps of a sharded `ChunkedHead`, the head run on two chunks outside the model's
    call, in `fully_shard([norm, head])` (grouped) or alone; gradients per step, final parameters."""
    torch.manual_seed(0)
    model = ChunkedHead()
    fs(model.embed)
    fs(model.body)
    fs([model.norm, model.head]) if grouped else (fs(model.norm), fs(model.head))
    fs(model)
    run = torch.compile(model, backend=compile_with) if compile_with is not None else model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        h = run(torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(10 * step + rank)), skip_head=True)
        h_grads = []
        for chunk in torch.chunk(h.detach(), 2, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).sum().backward()
            h_grads.append(chunk.grad)
        h.backward(torch.cat(h_grads, dim=1))
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _pair(mp=None, mesh=None):
    """(ours, torch's): the same seeded Net, sharded per embedding, per block, then the root."""
    torch.manual_seed(0)
    net = Net()
    out = []
    for fs, mp_cls in ((fully_shard, MixedPrecisionPolicy), (torch_fully_shard, TorchMixedPrecisionPolicy)):
        model = copy.deepcopy(net)
        kwargs = {"mesh": mesh} if mesh is not None else {}
        if mp:
            kwargs["mp_policy"] = mp_cls(**mp)
        fs(model.emb, **kwargs)
        shard_blocks_then_root(model, fs, **kwargs)
        out.append(model)
    return out


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (4, 3), generator=gen), torch.randn(4, generator=gen)


def _step(model, step, rank):
    tokens, y = _batch(step, rank)
    loss = nn.functional.mse_loss(model(tokens).float(), y)
    loss.backward()
    return loss


def _assert_same_grads(ours, theirs, rtol=1e-5, atol=1e-7, what=""):
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert (p.grad is None) == (q.grad is None), f"{what} {name}"
        if p.grad is not None:
            torch.testing.assert_close(
                p.grad.to_local(), q.grad.to_local(), rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}"
            )


class CountingAllGather(AllGather):
    def __init__(self):
        self.calls = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    def __init__(self):
        self.calls = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _divide_factor(rank, world_size):
    # set_gradient_divide_factor changes only the module it is called on. (torch's uses
    # PREMUL_SUM, which gloo lacks, unless sums are forced; ours always sums, then divides.)
    ours, theirs = _pair()
    for module in theirs.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    for model in (ours, theirs):
        model.set_gradient_divide_factor(3.0)
        _step(model, 0, rank)
    _assert_same_grads(ours, theirs, what="divide factor")
    assert ours.blocks[0]._fsdp_state.group.gradient_divide_factor is None


def _deprecated_divide_factor_alias(rank, world_size):
    # The deprecated alias warns and does the same.
    ours, theirs = _pair()
    theirs.blocks[1].set_force_sum_reduction_for_comms(True)
    for model in (ours, theirs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.blocks[1].set_reduce_scatter_divide_factor(5.0)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
        _step(model, 0, rank)
    _assert_same_grads(ours, theirs, what="deprecated alias")


def _bf16_accumulation_without_sync(rank, world_size):
    # Gradients accumulated without sync add up in reduce_dtype (fp32), not in bf16.
    ours, theirs = _pair(mp={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})
    for model in (ours, theirs):
        model.set_requires_gradient_sync(False)
        _step(model, 0, rank)
        _step(model, 1, rank)
        model.set_requires_gradient_sync(True)
        _step(model, 2, rank)
    _assert_same_grads(ours, theirs, what="bf16 accumulation")


def _post_accumulate_grad_hooks(rank, world_size):
    # Post-accumulate-grad hooks on the sharded parameters (optimizer in backward) run once per
    # reduced gradient and see it; a second backward adds to the same `.grad` tensor, in place,
    # also after zero_grad(set_to_none=False). [Note: The sharded gradient is the parameter's own]
    # Ours eager and compiled (whole step, aot_eager: [Note: Compiled gradients arrive as the
    # row's]), against torch's fully_shard in eager.
    import fsdp_graph

    for compile_with in (None, fsdp_graph.backend(compiler="aot_eager")):
        ours, theirs = _pair()
        hooked = []
        for model in (ours, theirs):
            run = torch.compile(model, backend=compile_with) if compile_with and model is ours else model
            seen = []
            for name, param in model.named_parameters():
                param.register_post_accumulate_grad_hook(lambda p, name=name: seen.append((name, p.grad.to_local().clone())))
            _step(run, 0, rank)
            first = [p.grad for p in model.parameters()]
            _step(run, 1, rank)
            assert all(a is p.grad for a, p in zip(first, model.parameters()))
            model.zero_grad(set_to_none=False)
            _step(run, 2, rank)
            assert all(a is p.grad for a, p in zip(first, model.parameters()))
            hooked.append(seen)
        what = f"post-accumulate-grad hooks, compiled={compile_with is not None}"
        # (The order differs: torch reduces the root's group before the embedding's, ours after.)
        hooked = [sorted(seen, key=lambda item: item[0]) for seen in hooked]
        assert [name for name, _ in hooked[0]] == [name for name, _ in hooked[1]] and len(hooked[0]) == 3 * 15, what
        for (name, got), (_, expected) in zip(*hooked):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}, hook on {name}: {m}")
        _assert_same_grads(ours, theirs, what=what)
        if compile_with is not None:
            assert not ours._fsdp_state.ctx.fallbacks, ours._fsdp_state.ctx.fallbacks


def _reduce_scatter_unused_params(rank, world_size):
    # set_reduce_scatter_unused_params(True): FSDP2 gives every trainable parameter of the groups it
    # reduces zeros where no rank had a gradient (also groups that did not run, once gathered), so
    # AdamW decays them; False leaves them None. Same gradients (None-ness too) and parameters.
    for flag in (False, True):
        routed = [_train_routed(fs, rank, flag) for fs in (fully_shard, torch_fully_shard)]
        _assert_same_routed(*routed, what=f"reduce_scatter_unused_params={flag}")
    assert routed[0][0][0]["unused.weight"] is not None and routed[0][0][0]["c.up.weight"] is None


def _unshard_handles(rank, world_size):
    # unshard(): None when waited, a handle when async.
    ours, theirs = _pair()
    for model in (ours, theirs):
        assert model.blocks[0].unshard() is None
        handle = model.blocks[1].unshard(async_op=True)
        assert handle is not None
        handle.wait()
        model.blocks[0].reshard()
        model.blocks[1].reshard()


def _all_reduce_hook(rank, world_size):
    # The all-reduce hook sees what FSDP2's sees (averaged; the sum with forced sums) and may
    # change the gradients in place.
    for force_sum in (False, True):
        ours, theirs = _pair()
        seen = []
        for model in (ours, theirs):
            captured = []

            def hook(reduced, captured=captured):
                captured.append(reduced.clone())
                reduced.mul_(2)

            model.set_force_sum_reduction_for_comms(force_sum)
            model.set_all_reduce_hook(hook)
            _step(model, 0, rank)
            seen.append(captured)
        assert len(seen[0]) == len(seen[1]) == 1
        torch.testing.assert_close(seen[0][0], seen[1][0], rtol=1e-5, atol=1e-7)
        _assert_same_grads(ours, theirs, what=f"all-reduce hook force_sum={force_sum}")


def _unshard_in_backward(rank, world_size):
    # set_unshard_in_backward(False) on the embedding: one all-gather fewer, same gradients.
    ours, theirs = _pair()
    counts = []
    for model in (ours, theirs):
        model.emb.set_unshard_in_backward(False)
        model.emb.set_reshard_after_forward(True)
        with CommDebugMode() as mode:
            _step(model, 0, rank)
        counts.append(comm_counts(mode))
    _assert_same_grads(ours, theirs, what="unshard_in_backward")
    assert counts[0] == counts[1], counts
    return {"unshard_in_backward counts": counts[0]}


def _reset_iter_state(rank, world_size):
    # reset_iter_state after a forward that raised, then a normal step.
    ours, theirs = _pair()
    for model in (ours, theirs):
        _step(model, 0, rank)
        model.fail = True
        with pytest.raises(RuntimeError, match="user error"):
            _step(model, 1, rank)
        model.fail = False
        model.reset_iter_state()
        _step(model, 2, rank)
    _assert_same_grads(ours, theirs, what="reset_iter_state")
    with pytest.raises(ValueError, match="root"):
        ours.blocks[0].reset_iter_state()


def _accepted_controls(rank, world_size):
    # Accepted controls, validated as FSDP2 validates them.
    ours, theirs = _pair()
    for model in (ours, theirs):
        model.set_reduce_scatter_unused_params(True)
        model.set_reduce_scatter_max_input_buffers(2)
        for bad, error in ((True, TypeError), (0, ValueError)):
            with pytest.raises(error):
                model.set_reduce_scatter_max_input_buffers(bad)


def _slicing_and_deepcopy(rank, world_size):
    # Slicing a sharded nn.Sequential gives a plain Sequential of the (sharded) blocks; deepcopy
    # of a sharded module is refused.
    ours, _ = _pair()
    for fs in (fully_shard, torch_fully_shard):
        seq = nn.Sequential(MLPBlock(8, 6), MLPBlock(8, 6), MLPBlock(8, 6))
        fs(seq[0])
        fs(seq)
        sliced = seq[1:]
        assert type(sliced) is nn.Sequential and len(sliced) == 2 and sliced[0] is seq[1]
    with pytest.raises(ValueError, match="deep"):
        copy.deepcopy(ours)


def _to_and_apply(rank, world_size):
    # .to() / _apply on a sharded module keeps it training like torch's.
    ours, theirs = _pair()
    for model in (ours, theirs):
        model.set_reshard_after_backward(False)
        _step(model, 0, rank)
        model.to(torch.float32)
        model.zero_grad()
        _step(model, 1, rank)
    _assert_same_grads(ours, theirs, what="after .to()")


def _share_comm_ctx(rank, world_size):
    # share_comm_ctx: two roots (pipeline stages) share one context and train as torch's.
    stages = []
    for fs, share in ((fully_shard, share_comm_ctx), (torch_fully_shard, torch_share_comm_ctx)):
        torch.manual_seed(1)
        a, b = MLPBlock(8, 6), MLPBlock(8, 6)
        fs(a)
        fs(b)
        share([a, b])
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        b(a(x)).sum().backward()
        stages.append((a, b))
    assert stages[0][0]._fsdp_state.ctx.comm is stages[0][1]._fsdp_state.ctx.comm
    for i in range(2):
        _assert_same_grads(stages[0][i], stages[1][i], what="share_comm_ctx")


def _custom_comms(rank, world_size):
    # Custom all-gather / reduce-scatter: called once per gather and reduction, same gradients.
    calls = []
    ours, theirs = _pair()
    for model in (ours, theirs):
        gather, reduce = CountingAllGather(), CountingReduceScatter()
        model.blocks[0].set_custom_all_gather(gather)
        model.blocks[0].set_custom_reduce_scatter(reduce)
        model.zero_grad()
        _step(model, 3, rank)
        calls.append((gather.calls, reduce.calls))
    _assert_same_grads(ours, theirs, what="custom comms")
    assert calls[0] == calls[1] == (2, 1), calls
    with pytest.raises(TypeError, match="allocate"):
        ours.set_custom_all_gather(lambda *args: None)


def _allocate_from_process_group(rank, world_size):
    # set_allocate_memory_from_process_group_for_comm(True): gloo's backend has no allocator of its
    # own, so both keep the caching allocator: same gradients. After a custom comm both refuse it.
    cpu = torch.device("cpu")
    assert not dist.group.WORLD._get_backend(cpu).supports_tensor_alloc(cpu)
    ours, theirs = _pair()
    for model in (ours, theirs):
        for module in model.modules():
            if hasattr(module, "set_allocate_memory_from_process_group_for_comm"):
                module.set_allocate_memory_from_process_group_for_comm(True)
        _step(model, 0, rank)
        model.blocks[0].set_custom_reduce_scatter(CountingReduceScatter())
    _assert_same_grads(ours, theirs, what="allocate from the process group")
    assert ours.blocks[0]._fsdp_state.group.allocate_from_process_group
    with pytest.raises(ValueError, match="custom all-gather or reduce-scatter"):
        ours.blocks[0].set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(AssertionError, match="custom"):
        theirs.blocks[0].set_allocate_memory_from_process_group_for_comm(True)


def _all_reduce_hook_stream(rank, world_size):
    # set_all_reduce_hook(hook, stream=...): the stream is kept (CUDA runs the hook on it: see
    # test_all_reduce_hook_runs_on_its_stream); the gradients are torch's with the same hook.
    ours, theirs = _pair()
    for model in (ours, theirs):
        model.set_all_reduce_hook(lambda reduced: reduced.mul_(3), stream=torch.cpu.Stream())
        _step(model, 0, rank)
    _assert_same_grads(ours, theirs, what="all-reduce hook with a stream")
    assert isinstance(ours._fsdp_state.group.reduce_controls.all_reduce_hook_stream, torch.cpu.Stream)
    with pytest.raises(TypeError, match="stream must be a stream"):
        ours.set_all_reduce_hook(lambda reduced: None, stream="side")


def _separate_reduce_scatter_group(rank, world_size):
    # set_separate_reduce_scatter_group: reduce-scatters on a group of their own, same gradients.
    ours, theirs = _pair()
    for model in (ours, theirs):
        model.set_separate_reduce_scatter_group()
        _step(model, 0, rank)
    _assert_same_grads(ours, theirs, what="separate reduce-scatter group")
    rs_group = ours.blocks[0]._fsdp_state.group.reduce_controls.reduce_scatter_group
    assert rs_group is not None and rs_group is ours._fsdp_state.group.reduce_controls.reduce_scatter_group
    assert rs_group is not ours._fsdp_state.group.mesh_info.shard_group


def _cpu_offload_pin_memory(rank, world_size):
    # CPUOffloadPolicy(pin_memory=True) needs a GPU to pin: both refuse it on a CPU-only machine.
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=False"):
            fully_shard(MLPBlock(8, 6), offload_policy=CPUOffloadPolicy(pin_memory=True))
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

        with pytest.raises(RuntimeError):
            torch_fully_shard(MLPBlock(8, 6), offload_policy=TorchCPUOffloadPolicy(pin_memory=True))


# FSDP2's controls, one scenario each (so that one failing shows the others' results), each on 2
# gloo ranks against torch's fully_shard doing the same.
_CONTROLS = [
    _divide_factor,
    _deprecated_divide_factor_alias,
    _bf16_accumulation_without_sync,
    _post_accumulate_grad_hooks,
    _reduce_scatter_unused_params,
    _unshard_handles,
    _all_reduce_hook,
    _unshard_in_backward,
    _reset_iter_state,
    _accepted_controls,
    _slicing_and_deepcopy,
    _to_and_apply,
    _share_comm_ctx,
    _custom_comms,
    _allocate_from_process_group,
    _all_reduce_hook_stream,
    _separate_reduce_scatter_group,
    _cpu_offload_pin_memory,
]


@pytest.mark.parametrize("scenario", _CONTROLS, ids=lambda scenario: scenario.__name__.lstrip("_"))
def test_fsdp2_controls_match_torch_fully_shard(scenario):
    figures = run_ranks(scenario, 2)
    if figures is not None:
        print(figures)


def _fp16_near_max(rank, world_size):
    """fp16 gradients of about 40000 on each rank: their sum (over 65504) overflows unless the
    division is split around it, as FSDP2 does (pre 2, post 1 on 2 ranks)."""
    results = {}
    x = torch.full((1, 4), 200.0 + 8 * rank)
    expected = torch.full((4, 4), 200.0 * (200.0 + 8 * 0.5))  # mean over ranks of 200 * x
    mp = {"param_dtype": torch.float16, "reduce_dtype": torch.float16}
    for name, fs, mp_cls in (
        ("ours", fully_shard, MixedPrecisionPolicy),
        ("torch", torch_fully_shard, TorchMixedPrecisionPolicy),
        ("ours_unsplit", fully_shard, MixedPrecisionPolicy),
    ):
        lin = nn.Linear(4, 4, bias=False)
        fs(lin, mp_policy=mp_cls(**mp))
        split = collectives.divide_factors
        if name == "ours_unsplit":
            collectives.divide_factors = lambda factor, dtype: (1.0, factor)
        try:
            (lin(x).float().sum() * 200).backward()
        finally:
            collectives.divide_factors = split
        grad = lin.weight.grad.full_tensor()
        results[name] = grad
    assert torch.isinf(results["ours_unsplit"]).all()
    torch.testing.assert_close(results["ours"], results["torch"], rtol=0, atol=0)
    torch.testing.assert_close(results["ours"], expected, rtol=1e-3, atol=0)
    return {k: v.flatten()[0].item() for k, v in results.items()}


def test_fp16_reduction_splits_the_division_like_fsdp2():
    figures = run_ranks(_fp16_near_max, 2)
    print(figures)


def _hsdp_partial(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, theirs = _pair(mesh=mesh)
    counts = []
    for model in (ours, theirs):
        model_counts = []
        model.set_requires_all_reduce(False)
        for step in range(2):
            with CommDebugMode() as mode:
                _step(model, step, rank)
            model_counts.append(comm_counts(mode))
        model.set_requires_all_reduce(True)
        with CommDebugMode() as mode:
            _step(model, 2, rank)
        model_counts.append(comm_counts(mode))
        counts.append(model_counts)
    _assert_same_grads(ours, theirs, what="HSDP partial reduce")
    assert counts[0] == counts[1], counts
    return counts[0]


def test_hsdp_requires_all_reduce_false_matches_torch_fully_shard():
    counts = run_ranks(_hsdp_partial, 4)
    print(counts)
    assert "allreduce_" not in counts[0] and counts[2].get("allreduce_") == 5


_DEFAULT_GROUP_SCRIPT = """
import os, torch, torch.distributed as dist
from fsdp_graph import fully_shard
model = torch.nn.Linear(4, 4)
fully_shard(model)  # no init_process_group: fully_shard makes the default group from the environment
assert dist.is_initialized() and dist.get_world_size() == 1
model(torch.randn(2, 4)).sum().backward()
print("trained", model.weight.grad.to_local().shape)
os._exit(0)  # [Note: Gloo teardown] in tests/_harness.py
"""


@pytest.mark.slow  # relaunches Python
def test_fully_shard_initialises_the_default_process_group():
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = run_process([sys.executable, "-c", _DEFAULT_GROUP_SCRIPT], env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trained torch.Size([4, 4])" in out.stdout


def _compiled(rank, world_size):
    """Compiled steps (aot_eager): the fp16 split, a separate reduce-scatter group in the graph,
    and an all-reduce hook on the eager hooks, each equal to the eager runtime bit for bit."""
    import fsdp_graph
    from _compile_helpers import train_compiled_and_compare
    from _models import MLPStack

    backend = fsdp_graph.backend(compiler="aot_eager")
    x = torch.full((1, 4), 200.0 + 8 * rank)
    grads = []
    for compile_it in (False, True):
        lin = nn.Linear(4, 4, bias=False)
        fully_shard(lin, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
        run = torch.compile(lin, backend=backend) if compile_it else lin
        (run(x).float().sum() * 200).backward()
        grads.append(lin.weight.grad.full_tensor())
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)

    def shard(model, control):
        shard_blocks_then_root(model)
        control(model)
        return model

    results = {}
    for name, control in (
        ("separate_rs_group", lambda m: m.set_separate_reduce_scatter_group()),
        # gloo has no allocator of its own: the graph runs, numbers as the unsharded model's
        ("pg_allocator", lambda m: [b.set_allocate_memory_from_process_group_for_comm(True) for b in (*m.blocks, m)]),
        ("all_reduce_hook", lambda m: m.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))),
    ):
        torch.manual_seed(0)
        model = MLPStack()
        if name == "all_reduce_hook":
            # The unsharded reference knows no hook: compare compiled with eager only.
            eager = shard(copy.deepcopy(model), control)
            compiled_module = shard(copy.deepcopy(model), control)
            compiled = torch.compile(compiled_module, backend=backend)
            gen = torch.Generator().manual_seed(rank)
            inp = torch.randn(4, 13, generator=gen)
            eager(inp).sum().backward()
            compiled(inp).sum().backward()
            _assert_same_grads(compiled_module, eager, rtol=0, atol=0, what=name)
            results[name] = dict(compiled_module._fsdp_state.ctx.fallbacks)
        else:
            results[name] = train_compiled_and_compare(
                model, lambda m: shard(m, control), backend, rank, world_size, steps=2
            )["fallbacks"]
    assert results["separate_rs_group"] == {} and results["pg_allocator"] == {}

    # A chunked loss: the head runs outside the compiled call, also when it shares a group with a
    # module that ran inside it ([Note: Groups whose forward ran partly in a graph]).
    expected = _train_chunked(torch_fully_shard, rank, grouped=True, steps=1)
    for compile_with in (None, backend):
        _assert_same_routed(_train_chunked(fully_shard, rank, True, compile_with, steps=1), expected,
                            what=f"chunked head, compiled={compile_with is not None}")

    # A group whose output is detached inside the graph (no gradient reaches it), one parameter
    # unused, with set_reduce_scatter_unused_params: compiled as torch's fully_shard in eager. One
    # step, one graph. (A group that ran in an earlier step but not in this one keeps `.grad` None
    # compiled, where FSDP2 gives zeros: docs/api.md, Differences from FSDP2.)
    compiled_run = _train_routed(fully_shard, rank, True, compile_with=backend, modes=("detached c",))
    expected = _train_routed(torch_fully_shard, rank, True, modes=("detached c",))
    _assert_same_routed(compiled_run, expected, what="compiled, unused params")
    assert results["all_reduce_hook"], results
    return results


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_compiled_steps_honour_the_controls():
    print(run_ranks(_compiled, 2))


class UpDown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, full: bool) -> torch.Tensor:
        x = self.up(x).relu()
        return self.down(x) if full else x


class TwiceCalled(nn.Module):
    """One group (`block`) called twice per forward, once with both its layers and once with `up`
    only, in either order; a block whose `down` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.block = UpDown()
        self.partial = HalfUsed()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, full_first: bool) -> torch.Tensor:
        x = self.block(self.block(x, full_first), not full_first)
        return self.head(self.partial(x)).sum()


def _train_twice_called(fs, rank, compile_with=None, orders=(True, False, True)):
    """AdamW steps of a sharded `TwiceCalled`, one per order (True: the full call first)."""
    torch.manual_seed(0)
    model = TwiceCalled()
    fs(model.block)
    fs(model.partial)
    fs(model)
    return _adamw_steps(model, compile_with, rank, orders)


def _twice_called(rank, world_size):
    """[Note: Flags that need no reading]: a group gathered twice in one compiled step, one call
    using every parameter and one not, keeps every gradient either call gave (whichever runs first),
    and a parameter no call used keeps `.grad` None, as torch's fully_shard in eager."""
    import fsdp_graph

    expected = _train_twice_called(torch_fully_shard, rank)
    compiled = _train_twice_called(fully_shard, rank, compile_with=fsdp_graph.backend(compiler="aot_eager"))
    _assert_same_routed(compiled, expected, what="group called twice")
    assert expected[0][0]["partial.down.weight"] is None and expected[0][0]["block.down.weight"] is not None


def test_compiled_group_called_twice_keeps_either_calls_gradients():
    run_ranks(_twice_called, 2)


def test_all_reduce_hook_runs_on_its_stream():
    """[Note: The all-reduce hook's stream] with stand-in streams (the order FSDP2 gives CUDA):
    the hook's stream waits for the reduction, the hook runs on it, the reduce-scatter stream (which
    divides and signals the gradients ready) waits for it."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    class DeviceModule:
        @contextlib.contextmanager
        def stream(self, stream):
            events.append(f"on {stream.name}")
            yield
            events.append(f"off {stream.name}")

    ctx = types.SimpleNamespace(uses_streams=True, reduce_scatter_stream=Stream("rs"), _device_module=DeviceModule())
    controls = collectives.ReduceControls(all_reduce_hook=lambda g: events.append("hook"), all_reduce_hook_stream=Stream("s"))
    work = collectives.ReduceScatterWork([], torch.zeros(2), None, 1.0, [], controls)
    work.run_all_reduce_hook(work.output, ctx)
    assert events == ["s waits for rs", "on s", "hook", "off s", "rs waits for s"]


def test_process_group_allocator_uses_the_backends_allocator_where_it_has_one():
    """FSDP2's `set_allocate_memory_from_process_group_for_comm`: a backend that allocates (NCCL)
    gives the buffers; one that cannot (gloo, here a stand-in) leaves them to the caching allocator."""
    from fsdp_graph.runtime.custom_comms import ProcessGroupAllocator

    calls = []

    class Backend:
        def __init__(self, allocates):
            self.allocates = allocates

        def supports_tensor_alloc(self, device):
            return self.allocates

        def allocate_tensor(self, numel, *, dtype, device):
            calls.append((numel, dtype, device))
            return torch.zeros(numel, dtype=dtype, device=device)

    for allocates in (True, False):
        group = types.SimpleNamespace(_get_backend=lambda device, b=Backend(allocates): b)
        buffer = ProcessGroupAllocator(group).allocate((6,), dtype=torch.bfloat16, device=torch.device("cpu"))
        assert buffer.shape == (6,) and buffer.dtype == torch.bfloat16
    assert calls == [(6, torch.bfloat16, torch.device("cpu"))]


def test_every_fsdp2_method_exists_and_the_unsupported_ones_say_so():
    """Every public method of torch's FSDPModule is callable on ours; the one we do not support
    raises a ValueError naming the call (never an AttributeError)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from _harness import fake_process_group
    from fsdp_graph import FSDPModule

    public = {n for n in dir(TorchFSDPModule) if not n.startswith("_") and callable(getattr(TorchFSDPModule, n))}
    assert public - set(dir(FSDPModule)) == set()
    with fake_process_group(2):
        model = fully_shard(nn.Linear(4, 4))
        model.set_allocate_memory_from_process_group_for_comm(False)
        model.set_allocate_memory_from_process_group_for_comm(True)
        with pytest.raises(ValueError, match="set_symm_mem_for_comm\\('NCCL'\\)"):
            model.set_symm_mem_for_comm("NCCL")


def test_calls_without_a_mesh_share_one_default_mesh_per_process_group():
    """[Note: One default mesh] in fsdp_graph/api/mesh.py: one mesh for every call without `mesh=`, equal
    to the one FSDP2 builds by default; a new default process group gets a new mesh. (The groups'
    meshes, not the parameters': torch may hand a DTensor an equal mesh from its own caches.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from _harness import fake_process_group

    def mesh_of(module):
        return module._fsdp_state.group.mesh_info.mesh

    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
        fully_shard(model[0])
        fully_shard(model[1])
        first = mesh_of(model[0])
        assert first is mesh_of(model[1]) and first == init_device_mesh("cpu", (2,))
    with fake_process_group(4):
        third = mesh_of(fully_shard(nn.Linear(4, 4, bias=False)))
        assert third is not first and third.size() == 4
