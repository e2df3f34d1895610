"""FSDP2 conformance of what one group may hold and take (issue #29, items 3, 4, 5, 6 and 12), each
against torch's own `fully_shard` doing the same, eager and, where the item reaches it, compiled.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_graph
from _harness import run_ranks
from _models import shard_blocks_then_root
from fsdp_graph import MixedPrecisionPolicy, fully_shard


def _compile(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_same_grads(got: nn.Module, expected: nn.Module, where: str) -> None:
    """Every parameter's gradient, present or None alike, equal to `expected`'s."""
    expected_params = dict(expected.named_parameters())
    for name, p in got.named_parameters():
        q = expected_params[name]
        assert (p.grad is None) == (q.grad is None), f"{where}: {name} grad presence differs"
        if p.grad is not None:
            torch.testing.assert_close(_local(p.grad), _local(q.grad), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: {name}.grad: {m}")


# -- item 3: a frozen layer before a trainable one in one group (LoRA) --------------------------------


class FrozenThenTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.trainable = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trainable(torch.relu(self.frozen(x)))


class LoraBlock(nn.Module):
    """A frozen base projection and a trainable low-rank adapter beside it, as PEFT's LoRA."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # LoRA starts B at zero; here A gets a gradient at once
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + 0.5 * self.lora_b(self.lora_a(x)))


class LoraNet(nn.Module):
    def __init__(self, dim: int = 12, rank: int = 3, num_blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(LoraBlock(dim, rank) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 1)
        self.inp.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)



def _train_against_torch(models: dict, batches: list, loss_of, label: str) -> list[float]:
    """Train `models` "torch", "eager" and "compiled" (run through `_compile`) on `batches` with
    AdamW over their trainable parameters. Every step, our losses and gradients equal torch's; at
    the end, every parameter (dtype included). Returns torch's losses."""
    runs = {name: _compile(m) if name == "compiled" else m for name, m in models.items()}
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for name, m in models.items()
    }
    losses = []
    for step, batch in enumerate(batches):
        step_losses = {}
        for name, run in runs.items():
            loss = loss_of(run, batch)
            loss.backward()
            step_losses[name] = loss.item()
        for name in ("eager", "compiled"):
            torch.testing.assert_close(step_losses[name], step_losses["torch"], rtol=1e-6, atol=0)
            _assert_same_grads(models[name], models["torch"], f"{label} {name} step {step}")
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
        losses.append(step_losses["torch"])
    expected = dict(models["torch"].named_parameters())
    for name in ("eager", "compiled"):
        for fqn, p in models[name].named_parameters():
            assert p.dtype == expected[fqn].dtype, f"{label} {name} {fqn}"
            torch.testing.assert_close(_local(p).float(), _local(expected[fqn]).float(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{label} {name} {fqn}: {m}")
    return losses

def _shard_lora(model: LoraNet, fs) -> LoraNet:
    shard_blocks_then_root(model, fs)
    return model


def _lora(rank, world_size):
    torch.manual_seed(0)
    # One group, frozen Linear first, the group's input needing a gradient: the input's gradient
    # reads the frozen weight after the trainable one's gradient is reduced.
    small = FrozenThenTrainable()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, fs, wrap in (("torch", torch_fully_shard, None), ("eager", fully_shard, None),
                           ("compiled", fully_shard, _compile)):
        model = fs(copy.deepcopy(small))
        run = model if wrap is None else wrap(model)
        for step in range(2):  # the second step gathers into the storage the first one freed
            inp = x.clone().requires_grad_(True)
            run(inp).pow(2).sum().backward()
            results[name, step] = (inp.grad, model)
    for step in range(2):
        for name in ("eager", "compiled"):
            torch.testing.assert_close(results[name, step][0], results["torch", step][0], rtol=1e-5, atol=1e-6)
            _assert_same_grads(results[name, step][1], results["torch", step][1], f"{name} step {step}")

    # The LoRA layout: adapters in every block, only they train, a few AdamW steps.
    net = LoraNet()
    models = {
        "torch": _shard_lora(copy.deepcopy(net), torch_fully_shard),
        "eager": _shard_lora(copy.deepcopy(net), fully_shard),
        "compiled": _shard_lora(copy.deepcopy(net), fully_shard),
    }
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(4, 12, generator=gen), torch.randn(4, generator=gen)  # one batch: the loss must fall
    losses = _train_against_torch(models, [(x, y)] * 3, lambda run, batch: F.mse_loss(run(batch[0]), batch[1]), "LoRA")
    return {"losses": losses, "fallbacks": dict(models["compiled"]._fsdp_state.ctx.fallbacks)}


def test_frozen_then_trainable_in_one_group_lora():
    result = run_ranks(_lora, 2)
    assert result["fallbacks"] == {}
    assert result["losses"][-1] < result["losses"][0]


# -- item 5: every module of fully_shard([a, b]) casts its own inputs ---------------------------------


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + self.b(x)).float()


def _cast_each_module(rank, world_size):
    torch.manual_seed(0)
    net = TwoBranches()
    models = {}
    for name, fs, mp_cls in (("torch", torch_fully_shard, TorchMixedPrecisionPolicy),
                             ("eager", fully_shard, MixedPrecisionPolicy),
                             ("compiled", fully_shard, MixedPrecisionPolicy)):
        model = copy.deepcopy(net)
        fs([model.a, model.b], mp_policy=mp_cls(param_dtype=torch.bfloat16, cast_forward_inputs=True))
        models[name] = fs(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    outs = {}
    for name, model in models.items():
        out = (_compile(model) if name == "compiled" else model)(x)
        out.pow(2).sum().backward()
        outs[name] = out
    for name in ("eager", "compiled"):
        torch.testing.assert_close(outs[name], outs["torch"], rtol=0, atol=0)
        _assert_same_grads(models[name], models["torch"], f"cast_forward_inputs {name}")
    return dict(models["compiled"]._fsdp_state.ctx.fallbacks)


def test_every_module_of_a_group_casts_its_inputs():
    assert run_ranks(_cast_each_module, 2) == {}


# -- item 4: a frozen float8 weight beside fp32 parameters, no param_dtype ------------------------------


class Float8Frozen(nn.Module):
    """A frozen float8 weight, registered first (the group's first parameter), then fp32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.w8 = nn.Parameter(torch.randn(6, 8).to(torch.float8_e4m3fn), requires_grad=False)
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.w8.dtype == torch.float8_e4m3fn  # the module computes with its own dtype
        return self.proj(F.linear(x, self.w8.to(torch.float32)))


def _float8_beside_fp32(rank, world_size):
    torch.manual_seed(0)
    net = nn.Sequential(Float8Frozen(), Float8Frozen())
    models = {}
    for name, fs in (("torch", torch_fully_shard), ("eager", fully_shard), ("compiled", fully_shard)):
        model = copy.deepcopy(net)
        for block in model:
            fs(block)
        models[name] = fs(model)
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(2)]
    _train_against_torch(models, batches, lambda run, x: run(x).pow(2).mean(), "float8")
    return dict(models["compiled"]._fsdp_state.ctx.fallbacks)


def test_float8_frozen_weight_beside_fp32_parameters():
    assert run_ranks(_float8_beside_fp32, 2) == {}


# -- item 6: ignored_params may hold parameters of other modules -------------------------------------


def _one_ignored_set_for_every_call(rank, world_size):
    torch.manual_seed(0)
    net = LoraNet()
    net.requires_grad_(True)
    models = {}
    for name, fs in (("torch", torch_fully_shard), ("eager", fully_shard)):
        model = copy.deepcopy(net)
        ignored = {model.head.weight, model.blocks[1].base.weight}  # one set, passed to every call
        for block in model.blocks:
            fs(block, ignored_params=ignored)
        models[name] = fs(model, ignored_params=ignored)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(rank))
    for model in models.values():
        model(x).pow(2).mean().backward()
    for model in models.values():
        assert not isinstance(model.head.weight, DTensor) and not isinstance(model.blocks[1].base.weight, DTensor)
        assert isinstance(model.head.bias, DTensor) and isinstance(model.blocks[1].base.bias, DTensor)
    _assert_same_grads(models["eager"], models["torch"], "ignored_params")  # ignored ones: local gradients


def test_ignored_params_may_hold_other_modules_parameters():
    run_ranks(_one_ignored_set_for_every_call, 2)


# -- item 12: parameters left on the meta device -----------------------------------------------------


def _meta_parameters(rank, world_size):
    errors = {}
    for name, fs in (("torch", torch_fully_shard), ("eager", fully_shard), ("compiled", fully_shard)):
        with torch.device("meta"):
            model = LoraNet(num_blocks=2)
        shard_blocks_then_root(model, fs)
        model.blocks[0].to_empty(device="cpu")  # materialized: not named in the error
        run = _compile(model) if name == "compiled" else model
        try:
            run(torch.randn(2, 12))
        except RuntimeError as e:  # what code written against FSDP2 catches
            errors[name] = e
    assert set(errors) == {"torch", "eager", "compiled"}, errors
    meta = ["inp.weight", "inp.bias", "blocks.1.base.weight", "blocks.1.base.bias", "blocks.1.lora_a.weight",
            "blocks.1.lora_b.weight", "head.weight", "head.bias"]
    for name in ("eager", "compiled"):
        assert isinstance(errors[name], ValueError), type(errors[name])
        message = str(errors[name])
        assert f"Parameters {meta} are still on the meta device" in message, message
        assert "model.to_empty(device=...)" in message and "reset_parameters()" in message, message


def test_meta_parameters_raise_runtime_error_naming_all():
    run_ranks(_meta_parameters, 2)
