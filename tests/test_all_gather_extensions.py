"""FSDP2's all-gather extension: a parameter whose class defines `fsdp_pre_all_gather` and
`fsdp_post_all_gather` is gathered as what the pre-hook returns and rebuilt by the post-hook.

The subclass (tests/_fp8_weight.py) gathers float8 bytes with a per-tensor scale. Against torch's
`fully_shard` with the same subclass: losses, every gradient, final parameters, and the bytes each
all-gather moves (1 per weight element, 4 per fp32 bias element).
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from _fp8_weight import Fp8AllGatherWeight
from _compile_helpers import dumped_graphs
from _harness import run_ranks
from _models import global_mean
from fsdp_graph import fully_shard


class _AllGatherBytes(TorchDispatchMode):
    """Records (dtype, bytes) of every all-gather collective's output.

    Only the collectives count: c10d's `_allgather_base_` (eager, output first), `allgather_`
    (eager, a list of per-rank output lists) and the functional `all_gather_into_tensor` (its
    result). Helper ops with "all_gather" in their name, such as FSDP2's `fsdp.all_gather_copy_in`,
    move nothing and are not recorded.
    """

    def __init__(self):
        super().__init__()
        self.gathers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name == "_allgather_base_":
            self._record([args[0]])
        elif namespace == "c10d" and name == "allgather_":
            self._record([t for per_rank in args[0] for t in per_rank])
        elif namespace == "_c10d_functional" and name.startswith("all_gather_into_tensor"):
            self._record(out if isinstance(out, (list, tuple)) else [out])
        return out

    def _record(self, outputs):
        dtypes = {t.dtype for t in outputs}
        assert len(dtypes) == 1, f"one all-gather moved several dtypes: {dtypes}"
        self.gathers.append((dtypes.pop(), sum(t.numel() * t.element_size() for t in outputs)))


def _fp8_mlp() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3, bias=False))
    for layer in model[0::2]:
        layer.weight = nn.Parameter(Fp8AllGatherWeight.wrap(layer.weight))
    return model


def _shard(model, shard, **kwargs):
    for layer in model[0::2]:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def _compare_grads_and_step(ours, theirs, opts) -> float:
    """Every gradient of `ours` against `theirs` (torch's), then one optimizer step each; returns
    the largest absolute difference."""
    max_err = 0.0
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        max_err = max(max_err, (p.grad.to_local() - q.grad.to_local()).abs().max().item())
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return max_err


def _against_torch(rank, world_size, reshard_after_forward):
    torch.manual_seed(0)
    model = _fp8_mlp()
    ours = _shard(copy.deepcopy(model), fully_shard, reshard_after_forward=reshard_after_forward)
    theirs = _shard(copy.deepcopy(model), torch_fully_shard, reshard_after_forward=reshard_after_forward)
    assert type(ours[0].weight.to_local()) is Fp8AllGatherWeight
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gathered, max_err = [], 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=gen)[rank * 4 : (rank + 1) * 4]
        losses = []
        for net in (ours, theirs):
            with _AllGatherBytes() as mode:
                loss = net(x).pow(2).mean()
                loss.backward()
            gathered.append(mode.gathers)
            losses.append(global_mean(loss))
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        max_err = max(max_err, _compare_grads_and_step(ours, theirs, opts))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert type(p.to_local()) is Fp8AllGatherWeight or p.ndim == 1, name
        torch.testing.assert_close(p.to_local()._data if p.ndim == 2 else p.to_local(),
                                   q.to_local()._data if q.ndim == 2 else q.to_local(), rtol=1e-5, atol=1e-6)
    return gathered[0::2], gathered[1::2], max_err


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fp8_all_gather_same_as_torch_fully_shard(reshard_after_forward):
    ours, theirs, max_err = run_ranks(_against_torch, 2, reshard_after_forward)
    assert ours == theirs  # same collectives, each of the same dtype and size
    # Per step: the three layers once in forward (+ again in backward when resharding); every
    # weight element is one byte, the middle layer's fp32 bias four. The last weight's 3 rows are
    # padded to 2 per rank, as torch pads them.
    weights, bias = 8 * 16 + 16 * 16 + 16 * 4, 16
    forward = [(torch.uint8, 8 * 16), (torch.uint8, 16 * 16 + 4 * bias), (torch.uint8, 16 * 4)]
    for step in ours:
        assert sorted(step[:3], key=str) == sorted(forward, key=str)
        assert sum(n for _, n in step[:3]) == weights + 4 * bias
    print(f"max abs gradient error vs torch fully_shard: {max_err}; forward all-gather bytes "
          f"{sum(n for _, n in ours[0][:3])} for {weights} (padded) weight + {bias} bias elements")


def _compiled_against_torch(rank, world_size, reshard_after_forward, dump_dir):
    """`torch.compile(backend=fsdp_graph.backend(compiler="aot_eager"))` of the sharded model against
    torch's eager `fully_shard`: same losses, gradients and parameters. The all-gathers are read
    from the graph dump (Dynamo does not compile while a dispatch mode is active, so the compiled
    steps run without `_AllGatherBytes`); torch's from its collectives."""
    torch.manual_seed(0)
    model = _fp8_mlp()
    sharded = _shard(copy.deepcopy(model), fully_shard, reshard_after_forward=reshard_after_forward)
    theirs = _shard(copy.deepcopy(model), torch_fully_shard, reshard_after_forward=reshard_after_forward)
    backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=f"{dump_dir}/rank{rank}")
    compiled = torch.compile(sharded, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sharded, theirs)]
    gathered, max_err = [], 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=gen)[rank * 4 : (rank + 1) * 4]
        loss = compiled(x).pow(2).mean()
        loss.backward()
        with _AllGatherBytes() as mode:
            expected = theirs(x).pow(2).mean()
            expected.backward()
        gathered.append(mode.gathers)
        torch.testing.assert_close(global_mean(loss), global_mean(expected), rtol=1e-6, atol=0)
        max_err = max(max_err, _compare_grads_and_step(sharded, theirs, opts))
    for (name, p), q in zip(sharded.named_parameters(), theirs.parameters()):
        local, expected = p.to_local(), q.to_local()
        if p.ndim == 2:
            assert type(local) is Fp8AllGatherWeight, name
            local, expected = local._data, expected._data
        torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    (forward_text,) = [path.read_text() for path in Path(f"{dump_dir}/rank{rank}").glob("*.forward.txt")]
    fp8_casts = forward_text.count("dtype=float8_e4m3fn)")  # the pre-hooks' casts, one per weight
    graphs = dumped_graphs(f"{dump_dir}/rank{rank}")
    return graphs, fp8_casts, gathered, max_err, dict(sharded._fsdp_state.ctx.fallbacks)


def _all_gathers(graph: dict) -> list[tuple[str, torch.dtype, int]]:
    """(group, dtype, bytes) of each all-gather in a dumped forward or backward graph."""
    return [(c["group"], getattr(torch, c["dtype"]), c["bytes"]) for c in graph["collectives"]
            if c["op"] == "all_gather_into_tensor"]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fp8_all_gather_compiled_same_as_torch_fully_shard(tmp_path, reshard_after_forward):
    """Compiled, the groups' hooks are traced into the graph: no group falls back to the eager hooks,
    and the graph's all-gathers carry the fp8 bytes, 1 per weight element, as torch's do."""
    graphs, fp8_casts, theirs, max_err, fallbacks = run_ranks(
        _compiled_against_torch, 2, reshard_after_forward, str(tmp_path)
    )
    assert fallbacks == {}, fallbacks
    assert fp8_casts == 3  # the pre-hooks ran in the graph: its all-gathers move fp8 bytes
    forward, backward = _all_gathers(graphs["forward"]), _all_gathers(graphs["backward"])
    # The forward gathers what torch's forward gathers, layer by layer: fp8 weights as bytes (the
    # last weight's 3 rows padded to 2 per rank) and the middle layer's fp32 bias.
    weights, bias = 8 * 16 + 16 * 16 + 16 * 4, 16
    assert forward == [("0", torch.uint8, 8 * 16), ("2", torch.uint8, 16 * 16 + 4 * bias), ("4", torch.uint8, 16 * 4)]
    for step in theirs:
        assert [(dtype, n) for _, dtype, n in forward] == step[:3]
    if reshard_after_forward:
        # The backward gathers again, from the shards through the pre-hook, what it needs: the last
        # two layers' weights (the first layer's weight gradient needs no weight, and the input
        # needs no gradient). Torch's backward gathers all three, group 0 last.
        assert backward == [("4", torch.uint8, 16 * 4), ("2", torch.uint8, 16 * 16 + 4 * bias)]
        for step in theirs:
            assert [(dtype, n) for _, dtype, n in backward] == step[3:5]
            assert step[5] == (torch.uint8, 8 * 16)
    else:
        assert backward == [] and all(len(step) == 3 for step in theirs)
    print(f"compiled (reshard_after_forward={reshard_after_forward}): max abs gradient error vs torch "
          f"fully_shard {max_err}; graph all-gathers (group, dtype, bytes) forward {forward}, backward "
          f"{backward}, for {weights} (padded) weight + {bias} bias elements")


class _UsesOne(nn.Module):
    """Two fp8 layers in one group; the forward uses only the first."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        for layer in (self.used, self.unused):
            layer.weight = nn.Parameter(Fp8AllGatherWeight.wrap(layer.weight))

    def forward(self, x):
        return self.used(x)


def _compiled_unused_against_torch(rank, world_size, mixed_precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    torch.manual_seed(0)
    model = _UsesOne()
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else {}
    ours = fully_shard(copy.deepcopy(model), mp_policy=fsdp_graph.MixedPrecisionPolicy(**dtypes))
    theirs = torch_fully_shard(copy.deepcopy(model), mp_policy=TorchMixedPrecisionPolicy(**dtypes))
    compiled = torch.compile(ours, backend=fsdp_graph.backend(compiler="aot_eager"))
    for step in range(2):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))[rank * 4 : (rank + 1) * 4]
        loss, expected = (net(x).float().pow(2).mean() for net in (compiled, theirs))
        loss.backward()
        expected.backward()
        torch.testing.assert_close(global_mean(loss), global_mean(expected), rtol=1e-6, atol=0)
        assert ours.unused.weight.grad is None and theirs.unused.weight.grad is None
        for name in ("used.weight", "used.bias"):
            mine, torchs = ours.get_parameter(name).grad, theirs.get_parameter(name).grad
            torch.testing.assert_close(mine.to_local(), torchs.to_local(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        for net in (ours, theirs):
            net.zero_grad(set_to_none=True)
    return dict(ours._fsdp_state.ctx.fallbacks)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_fp8_compiled_unused_parameter_keeps_grad_none(mixed_precision):
    """A hooked parameter the forward does not use gets no gradient, compiled as in torch's eager
    fully_shard (the graph reduce-scatters zeros and a flag for it), with bf16 parameters too."""
    assert run_ranks(_compiled_unused_against_torch, 2, mixed_precision) == {}


class _OnlyPre(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self,), None


class _BadArity(Fp8AllGatherWeight):
    def fsdp_pre_all_gather(self, mesh, outer_size):
        return super().fsdp_pre_all_gather(mesh, outer_size, None, None, None)


class _BadResult(Fp8AllGatherWeight):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self._data  # not (inputs, metadata)


def test_all_gather_extension_misuse():
    from _harness import fake_process_group

    with fake_process_group(2):
        only_pre = nn.Linear(4, 4)
        only_pre.weight = nn.Parameter(only_pre.weight.detach().as_subclass(_OnlyPre))
        with pytest.raises(ValueError, match="defines only one of fsdp_pre_all_gather and fsdp_post_all_gather"):
            fully_shard(only_pre)
        bad_arity = nn.Linear(4, 4)
        bad_arity.weight = nn.Parameter(_BadArity.wrap(bad_arity.weight))
        with pytest.raises(TypeError, match=r"takes 2 arguments; FSDP2's contract is \(mesh, orig_size"):
            fully_shard(bad_arity)
        dim1 = nn.Linear(4, 4)
        dim1.weight = nn.Parameter(Fp8AllGatherWeight.wrap(dim1.weight))
        with pytest.raises(ValueError, match=r"dim 0 only; return Shard\(0\)"):
            fully_shard(dim1, shard_placement_fn=lambda p: Shard(1))
        bad_result = nn.Linear(4, 4)
        bad_result.weight = nn.Parameter(_BadResult.wrap(bad_result.weight))
        fully_shard(bad_result)
        with pytest.raises(TypeError, match=r"return \(all_gather_inputs, metadata\)"):
            bad_result.unshard()


def _patch_bf16_hooks(model, seen: dict) -> None:
    """Set FSDP2's extensions on every weight's local tensor (a plain fp32 tensor), as FSDP2's own
    monkey-patch test does: gather bf16, upcast after. `seen` counts pre-hook calls and records the
    meshes the pre-hook got."""

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen["calls"] += 1
        seen["meshes"].add((mesh.ndim, mesh.size()))
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return
        full = gathered.to(param_dtype)
        return full, (gathered, full)

    for name, param in model.named_parameters():
        if name.endswith("weight"):
            local = param._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)


def _instance_hooks_against_torch(rank, world_size, compiled, hsdp):
    """Extensions set on the local tensors after `fully_shard` and `to_empty()`, eager or compiled,
    against torch's eager `fully_shard` patched alike: same losses, gradients and parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard")) if hsdp else None
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    nets, seen = [], []
    for shard in (fully_shard, torch_fully_shard):
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        _shard(net, shard, mesh=mesh)
        net.to_empty(device="cpu")
        with torch.no_grad():
            for p, q in zip(net.parameters(), init.parameters()):  # this rank's rows of the same init
                p.to_local().copy_(q.chunk(world_size)[rank])
        seen.append({"calls": 0, "meshes": set()})
        _patch_bf16_hooks(net, seen[-1])  # after to_empty: it made new local tensors
        nets.append(net)
    ours, theirs = nets
    run = torch.compile(ours, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else ours
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    max_err = 0.0
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))[rank * 4 : (rank + 1) * 4]
        loss, expected = run(x).pow(2).mean(), theirs(x).pow(2).mean()
        loss.backward()
        expected.backward()
        torch.testing.assert_close(global_mean(loss), global_mean(expected), rtol=1e-6, atol=0)
        max_err = max(max_err, _compare_grads_and_step(ours, theirs, opts))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Without the hooks the weights would be gathered in fp32, and the losses differ at 1e-3.
    return seen[0], seen[1], max_err, dict(ours._fsdp_state.ctx.fallbacks)


@pytest.mark.parametrize("compiled,hsdp", [(False, False), (True, False), (False, True), (True, True)])
def test_extensions_set_on_the_local_tensor_instance(compiled, hsdp):
    """FSDP2 looks the extensions up on the local tensor at every all-gather, so hooks set on the
    tensor instance after fully_shard/to_empty run (never silently skipped), in eager and compiled
    steps, and get the shard axis' 1-D mesh under HSDP; numbers as torch's fully_shard."""
    ours, theirs, max_err, fallbacks = run_ranks(_instance_hooks_against_torch, 2, compiled, hsdp)
    assert fallbacks == {}, fallbacks
    assert ours["calls"] > 0 and theirs["calls"] > 0
    assert ours["meshes"] == theirs["meshes"] == {(1, 2)}
    print(f"compiled={compiled} hsdp={hsdp}: pre-hook calls ours {ours['calls']}, torch {theirs['calls']}; "
          f"max abs gradient error vs torch fully_shard {max_err}")
