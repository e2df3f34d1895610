"""Parameters replaced or converted after `fully_shard`, as frameworks do it (issue #45 items 1-2),
against torch's `fully_shard` and an unsharded model, eager and compiled, on 2 gloo ranks.

torchtitan builds on meta, shards, then `to_empty()` and initialises, and calls its `[norm,
lm_head]` group outside the compiled model (a chunked loss); Accelerate and HF load a meta model with
`load_state_dict(assign=True)`; torch's own tests assign a new parameter to the root. See [Note: The
sharded parameter is the one its module holds] in runtime/param.py.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp_graph
from _harness import run_ranks
from _models import Llama, LlamaConfig, batch_for_step, check_grads_match, global_mean, loss_fn, shard_blocks_then_root
from fsdp_graph import fully_shard
from fsdp_graph.runtime.param_group import ShardedState

_CFG = LlamaConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, hidden_dim=56)


class HiddenStatesLlama(Llama):
    """torchtitan's decoder: with `skip_head` the forward ends after the final norm."""

    skip_head = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        return h if self.skip_head else self.output(h)


def _shard_like_torchtitan(model, fs):
    for layer in model.layers:
        fs(layer)
    fs([model.norm, model.output])
    fs(model)
    return model


class _HiddenGrad(torch.autograd.Function):
    """Hands a gradient computed outside the model to its hidden states (torchtitan's
    `_DecoderOutputGradientBackProp`)."""

    @staticmethod
    def forward(ctx, hidden, grad, loss):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def _chunked_loss(head, hidden, labels, num_chunks=2):
    """torchtitan's ChunkedLossWrapper, reduced: the head runs per chunk outside the model, keeps
    its parameters gathered, reduces its gradients once (on the last chunk), and the accumulated
    gradient of the hidden states goes back through the model in the caller's backward."""
    num_tokens = labels.numel()
    chunks = [c.detach().requires_grad_() for c in hidden.chunk(num_chunks, dim=1)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total, grads = hidden.new_zeros(()), []
    for i, (h, y) in enumerate(zip(chunks, labels.chunk(num_chunks, dim=1))):
        if i == num_chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = F.cross_entropy(head(h).flatten(0, 1), y.flatten(), reduction="sum") / num_tokens
        loss.backward()
        grads.append(h.grad)
        total = total + loss.detach()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    return _HiddenGrad.apply(hidden, torch.cat(grads, dim=1), total)


def _meta_model_like(reference):
    """A meta-device copy of `reference`'s architecture, and `init` that fills a materialised one
    with `reference`'s values (deterministic "init_weights")."""
    with torch.device("meta"):
        model = HiddenStatesLlama(_CFG)
    values = reference.state_dict()

    def init(materialised):
        with torch.no_grad():
            for name, p in materialised.named_parameters():
                full = values[name]
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
        materialised.reset_buffers()

    return model, init


def _compiled(model, compiler, how):
    """`model` compiled with our backend: `torch.compile(model)`, `model.compile()` (in place, as
    torchtitan and Lightning compile), or torch's own `nn.Module.compile` (which compiles
    `_call_impl`: the root's hooks run eagerly around a traced body)."""
    backend = fsdp_graph.backend(compiler=compiler)
    if how == "torch.compile":
        return torch.compile(model, backend=backend)
    if how == "module.compile":
        model.compile(backend=backend)
    else:
        nn.Module.compile(model, backend=backend)
    return model


def _torchtitan_loop(rank, world_size, compiler, how="torch.compile"):
    torch.manual_seed(0)
    reference = HiddenStatesLlama(_CFG)
    losses = {}
    grads_of_head = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model, init = _meta_model_like(reference)
        _shard_like_torchtitan(model, fs)
        model.to_empty(device="cpu")  # converts every DTensor parameter with swap_tensors
        init(model)
        model.skip_head = True
        run = model if name == "torch" or compiler is None else _compiled(model, compiler, how)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name], grads_of_head[name] = [], []
        for step in range(4):
            _, _, x, y = batch_for_step(reference, step, 8, rank, world_size)
            hidden = run(x)
            if how == "module.compile" and name == "ours":  # the root's gather ran in the graph, not eagerly
                assert model._fsdp_state.group.state is ShardedState.SHARDED
            loss = _chunked_loss(model.output, hidden, y)
            loss.backward()
            assert model.output.weight.grad is not None, f"{name} step {step}: the head's gradient was dropped"
            grads_of_head[name].append(model.output.weight.grad.to_local().clone())
            losses[name].append(loss.item())
            opt.step()
            opt.zero_grad()
    if compiler is not None and how != "nn.Module.compile":
        assert model._fsdp_state.ctx.fallbacks.keys() <= {"norm, output"}, model._fsdp_state.ctx.fallbacks
    return losses, grads_of_head


@pytest.mark.parametrize(
    "compiler, how",
    [(None, None), ("aot_eager", "torch.compile"), ("aot_eager", "module.compile"), ("aot_eager", "nn.Module.compile")],
    ids=["eager", "torch.compile", "module.compile", "nn.Module.compile"],
)
def test_torchtitan_meta_init_and_chunked_head(compiler, how):
    """Whole-step compile of a model built on meta, `to_empty`'d, with its head called outside the
    compiled forward: the head's gradient was None every step (its watch hook was lost with
    swap_tensors, and the compiled backward reset the eagerly written gradient). Compiled in place
    (`model.compile()`, torchtitan's way) the root's hooks ran outside the graph and the head's
    gathered weight leaked out of it ("backward through the graph a second time")."""
    losses, grads = run_ranks(_torchtitan_loop, 2, compiler, how)
    assert losses["ours"] == losses["torch"], losses  # aot_eager and eager: bit for bit
    for step, (ours, theirs) in enumerate(zip(grads["ours"], grads["torch"])):
        assert torch.equal(ours, theirs), f"step {step}"


def _train_both(rank, world_size, prepare, compiler, steps=3):
    """Losses and sharded gradients of `steps` AdamW steps of `prepare(fully_shard)`, with torch's
    `fully_shard` (eager) and ours (compiled with `compiler`, or eager for None)."""
    torch.manual_seed(0)
    reference = HiddenStatesLlama(_CFG)
    results = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model = prepare(fs, reference, rank)
        run = model if name == "torch" or compiler is None else torch.compile(
            model, backend=fsdp_graph.backend(compiler=compiler)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(steps):
            _, _, x, y = batch_for_step(reference, step, 8, rank, world_size)
            loss = loss_fn(model, run(x), y)
            loss.backward()
            losses.append(loss.item())
            grads.append({n: None if p.grad is None else p.grad.to_local().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        results[name] = (losses, grads)
    return results


def _check_same_training(results):
    (our_losses, our_grads), (their_losses, their_grads) = results["ours"], results["torch"]
    assert our_losses == their_losses, (our_losses, their_losses)
    for step, (ours, theirs) in enumerate(zip(our_grads, their_grads)):
        for name, grad in theirs.items():
            assert (ours[name] is None) == (grad is None), f"step {step} {name}"
            assert grad is None or torch.equal(ours[name], grad), f"step {step} {name}"


def _sharded_on_meta(fs, reference):
    with torch.device("meta"):
        model = HiddenStatesLlama(_CFG)
    return shard_blocks_then_root(model, fs)


def _loaded_with_assign(fs, reference, rank):
    """Accelerate's cpu_ram_efficient_loading and HF's meta loading: a meta model, sharded, then
    `load_state_dict(sharded_state, assign=True)`."""
    model = _sharded_on_meta(fs, reference)
    full = reference.state_dict()
    sharded = {
        name: distribute_tensor(full[name], p.device_mesh, p.placements) for name, p in model.named_parameters()
    }
    model.load_state_dict(sharded, strict=False, assign=True)
    return _with_buffers(model)


def _with_buffers(model):
    """The rotary tables (not in the state dict) made on the CPU and filled."""
    model.register_buffer("rope_cos", torch.empty_like(model.rope_cos, device="cpu"), persistent=False)
    model.register_buffer("rope_sin", torch.empty_like(model.rope_sin, device="cpu"), persistent=False)
    model.reset_buffers()
    return model


def _broadcast_from_rank0(fs, reference, rank):
    """torch's `set_model_state_dict(..., broadcast_from_rank0=True)` onto a meta model."""
    model = _sharded_on_meta(fs, reference)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, reference.state_dict() if rank == 0 else {}, options=options)
    return _with_buffers(model)


def _root_param_assigned(fs, reference, rank):
    """torch's `test_reset_sharded_param_in_lazy_init`: the blocks materialised, then the root's own
    parameters assigned anew (a DTensor computed from the sharded blocks' parameters)."""
    model = _sharded_on_meta(fs, reference)
    for layer in model.layers:
        layer.to_empty(device="cpu")
    full = reference.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                p.copy_(distribute_tensor(full[name], p.device_mesh, p.placements))
        mesh, placements = model.layers[0].attention.wq.weight.device_mesh, model.layers[0].attention.wq.weight.placements
        for owner, attr in ((model.tok_embeddings, "weight"), (model.norm, "weight"), (model.output, "weight")):
            name = f"{[n for n, m in model.named_modules() if m is owner][0]}.{attr}"
            setattr(owner, attr, nn.Parameter(distribute_tensor(full[name], mesh, placements)))
    return _with_buffers(model)


@pytest.mark.parametrize("compiler", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("prepare", [_loaded_with_assign, _broadcast_from_rank0, _root_param_assigned])
def test_parameters_replaced_before_the_first_forward(prepare, compiler):
    """FSDP2 takes the new tensors at its lazy init. Before, the meta check fired with an empty list
    of names (it read the replaced meta shards, and named the module's current parameters)."""
    _check_same_training(run_ranks(_train_both, 2, prepare, compiler))


class _Branches(nn.Module):
    """Blocks of which `use_extra` picks whether the last one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.extra = nn.Linear(6, 6)
        self.use_extra = True

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        if self.use_extra:
            x = x + self.extra(x)
        return x.sum(-1)


def _unused_after_meta_init(rank, world_size, set_to_none, compiler):
    """Per step: whether the extra block ran, and each model's `.grad` of it (None or its values)."""
    torch.manual_seed(0)
    values = _Branches().state_dict()
    uses = [True, False, True, False, False]
    seen = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        with torch.device("meta"):
            model = _Branches()
        for block in model.blocks:
            fs(block)
        fs(model)  # `inp` and `extra`: a group that runs every step, partly
        model.to_empty(device="cpu")  # swap_tensors: the watch of every shard must come back
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(distribute_tensor(values[n], p.device_mesh, p.placements))
        run = model if name == "torch" or compiler is None else torch.compile(
            model, backend=fsdp_graph.backend(compiler=compiler)
        )
        seen[name] = []
        for step, use in enumerate(uses):
            model.use_extra = use
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            run(x).pow(2).mean().backward()
            grad = model.extra.weight.grad
            seen[name].append(None if grad is None else grad.to_local().clone())
            if step % 2 == 1:  # accumulate over steps 0-1 and 2-3, then clear
                model.zero_grad(set_to_none=set_to_none)
    return seen


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad_to_none", "zero_grad_to_zeros"])
def test_unused_parameter_keeps_its_gradient_after_meta_init(set_to_none):
    """A compiled step in which a group is unused leaves its `.grad` as it was: an accumulated
    gradient stays, zeros stay zeros, None stays None (as torch's fully_shard). Before, after
    `to_empty` the compiled backward turned all three into None."""
    seen = run_ranks(_unused_after_meta_init, 2, set_to_none, "aot_eager")
    for step, (ours, theirs) in enumerate(zip(seen["ours"], seen["torch"])):
        assert (ours is None) == (theirs is None), f"step {step}: ours {ours is None}, torch's {theirs is None}"
        assert theirs is None or torch.equal(ours, theirs), f"step {step}"
    assert seen["torch"][4] is None if set_to_none else seen["torch"][4] is not None  # the test reads both cases


def _reference_and_other_values():
    """A seeded model, and the state dict of a second one (other values for the same names)."""
    torch.manual_seed(0)
    return HiddenStatesLlama(_CFG), HiddenStatesLlama(_CFG).state_dict()


def _replaced_between_steps(rank, world_size, compiler, how):
    """Three steps; before the third, every parameter of the first block is replaced by other values,
    with `load_state_dict(assign=True)` or by assigning each (which no hook of ours sees). Returns
    the losses of torch's `fully_shard`, ours, and the unsharded model replaced the same way."""
    reference, other = _reference_and_other_values()
    losses = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard), ("unsharded", None)):
        model = copy.deepcopy(reference)
        if fs is not None:
            _shard_like_torchtitan(model, fs)
        run = model if name != "ours" or compiler is None else torch.compile(
            model, backend=fsdp_graph.backend(compiler=compiler)
        )
        losses[name] = []
        for step in range(3):
            if step == 2:
                block = model.layers[0]
                new = {
                    n: nn.Parameter(
                        distribute_tensor(other[f"layers.0.{n}"], p.device_mesh, p.placements)
                        if isinstance(p, DTensor) else other[f"layers.0.{n}"].clone()
                    )
                    for n, p in block.named_parameters()
                }
                if how == "load_state_dict":
                    block.load_state_dict(new, assign=True)
                else:
                    for n, p in new.items():
                        owner, _, attr = n.rpartition(".")
                        setattr(block.get_submodule(owner), attr, p)
            x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
            with torch.no_grad():
                loss = loss_fn(model, run(x), y) if fs is None else loss_fn(model, run(lx), ly)
            losses[name].append(loss.item() if fs is None else global_mean(loss))
    return losses


@pytest.mark.parametrize("how", ["load_state_dict", "setattr"])
def test_parameters_replaced_between_compiled_steps(how):
    """The compiled step reads the parameters the modules hold now: followed by the load hook, or,
    assigned behind every hook's back, by a recompile (the traced root guards a count of such
    assignments). torch's `fully_shard` takes an assigned parameter only at its lazy init, before
    the first forward: later it trains on (see docs/api.md's differences from FSDP2)."""
    losses = run_ranks(_replaced_between_steps, 2, "aot_eager", how)
    torch.testing.assert_close(losses["ours"], losses["unsharded"], rtol=1e-5, atol=0)
    assert losses["ours"][2] != losses["ours"][1]
    if how == "load_state_dict":
        assert losses["ours"] == losses["torch"], losses


def _bad_replacements(rank, world_size, compiler):
    messages = []
    tokens = torch.zeros(2, 8, dtype=torch.long)
    for case in ("meta", "plain tensor"):
        with torch.device("meta"):
            model = HiddenStatesLlama(_CFG)
        _shard_like_torchtitan(model, fully_shard)
        if case == "meta":
            model.layers[0].to_empty(device="cpu")
        else:
            model.to_empty(device="cpu")
            model.layers[1].attention.wq.weight = nn.Parameter(torch.zeros(32, 32))
        run = model if compiler is None else torch.compile(model, backend=fsdp_graph.backend(compiler=compiler))
        try:
            run(tokens)
        except ValueError as error:  # MetaParameterError is also the RuntimeError FSDP2 raises
            messages.append(str(error))
    return messages


@pytest.mark.parametrize("compiler", [None, "aot_eager"], ids=["eager", "compiled"])
def test_meta_and_bad_replacements_are_named(compiler):
    meta_error, replaced_error = run_ranks(_bad_replacements, 2, compiler)
    names = meta_error.split("]")[0].split("[")[1]
    assert "layers.1.attention.wq.weight" in names and "output.weight" in names, meta_error
    assert "layers.0" not in names, meta_error  # materialised
    assert "'layers.1.attention.wq.weight'" in replaced_error and "distribute_tensor" in replaced_error, replaced_error


def _optimizer_of_replaced_parameters(rank, world_size):
    """An optimizer built before `load_state_dict(assign=True)` holds the replaced shards: its step
    is refused, naming one, instead of silently updating tensors no forward reads."""
    torch.manual_seed(0)
    reference = HiddenStatesLlama(_CFG)
    model = _shard_like_torchtitan(copy.deepcopy(reference), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    values = reference.state_dict()
    model.load_state_dict(
        {n: nn.Parameter(distribute_tensor(values[n], p.device_mesh, p.placements)) for n, p in model.named_parameters()},
        strict=False, assign=True,
    )
    _, _, x, y = batch_for_step(reference, 0, 8, rank, world_size)
    loss_fn(model, model(x), y).backward()
    try:
        optimizer.step()
    except ValueError as error:
        return str(error)
    return None


def test_optimizer_of_replaced_parameters_is_refused():
    message = run_ranks(_optimizer_of_replaced_parameters, 2)
    assert message is not None and "Build the optimizer after fully_shard" in message, message


def _loaded_by_swapping(rank, world_size, compiler):
    """`load_state_dict` under `torch.__future__.set_swap_module_params_on_conversion(True)` swaps
    every shard's TensorImpl (as `to_empty` does); then train a few steps. Returns the losses."""
    reference, other = _reference_and_other_values()
    losses = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model = _shard_like_torchtitan(copy.deepcopy(reference), fs)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.load_state_dict({n: distribute_tensor(other[n], p.device_mesh, p.placements) for n, p in model.named_parameters()}, strict=False)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        run = model if name == "torch" else torch.compile(model, backend=fsdp_graph.backend(compiler=compiler))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for step in range(3):
            _, _, x, y = batch_for_step(reference, step, 8, rank, world_size)
            loss = loss_fn(model, run(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return losses


def test_state_dict_loaded_by_swapping_tensors():
    losses = run_ranks(_loaded_by_swapping, 2, "aot_eager")
    assert losses["ours"] == losses["torch"], losses


class _WeightNormModel(nn.Module):
    """torch's `test_reset_sharded_param_in_lazy_init` model: a root parameter computed, after
    `fully_shard`, from the sharded blocks' parameters and assigned anew."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)  # a DTensor: the norm of sharded weights

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _reset_sharded_param_in_lazy_init(rank, world_size):
    results = {}
    for name, fs in (("torch", torch_fully_shard), ("ours", fully_shard)):
        with torch.device("meta"):
            model = _WeightNormModel()
        fs(model.layer1)
        fs(model.layer2)
        fs(model)
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
        torch.manual_seed(0)
        model.layer1.reset_parameters()
        model.layer2.reset_parameters()
        model.init_weight_norm()
        x = torch.randn(3, 3, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        results[name] = {n: (p.to_local().clone(), p.grad.to_local().clone()) for n, p in model.named_parameters()}
    return results


def test_torchs_reset_sharded_param_in_lazy_init():
    """torch's own FSDP2 test, with both `fully_shard`s: it failed with fsdp_graph's meta check
    ("Parameters [] are still on the meta device")."""
    results = run_ranks(_reset_sharded_param_in_lazy_init, 2)
    for name, (param, grad) in results["torch"].items():
        assert torch.equal(results["ours"][name][0], param) and torch.equal(results["ours"][name][1], grad), name
