"""FSDP1 conveniences over full (unsharded) parameters: summon them, save and load them, and pause
gradient synchronisation.

Everything here works parameter by parameter, so no rank ever holds more than one full parameter
beyond its shards (rank 0 holds the full state dict it saves or loads, as in FSDP1).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ..runtime.param import ShardedParam
from ..api.module import _fsdp_states as _states
from ..runtime.state import FSDPState, TrainingState




def _check_idle(states: list[FSDPState], caller: str) -> None:
    busy = [s.name for s in states if s.training_state is not TrainingState.IDLE]
    if busy or torch._C._current_graph_task_id() != -1:
        raise ValueError(
            f"{caller} cannot run inside forward or backward (groups busy: {busy or 'backward'}); "
            f"call it between training steps"
        )


def _sharded_params(states: list[FSDPState]) -> list[ShardedParam]:
    return [p for s in states if s.group is not None for p in s.group.params]


@contextlib.contextmanager
def summon_full_params(
    model: nn.Module, writeback: bool = True, rank0_only: bool = False, with_grads: bool = False
) -> Iterator[None]:
    """Inside the block the modules hold full parameters (plain tensors, original dtype).

    With `writeback`, edits made to them are written back to the shards on exit. With
    `rank0_only`, only rank 0 gets the full parameters (the others keep their shards); it cannot
    be combined with `writeback`. With `with_grads`, full gradients are summoned too.
    """
    for name, value in (("writeback", writeback), ("rank0_only", rank0_only), ("with_grads", with_grads)):
        if not isinstance(value, bool):
            raise TypeError(f"summon_full_params: {name} must be a bool, got {value!r}")
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) would lose the other ranks' edits; "
            "pass writeback=False, or rank0_only=False"
        )
    states = _states(model, "summon_full_params")
    _check_idle(states, "summon_full_params")
    for state in states:
        if state.group is not None:
            state.group.reshard()
    params = _sharded_params(states)
    summoned: list[tuple[ShardedParam, nn.Parameter]] = []
    keep = not rank0_only or dist.get_rank() == 0
    with torch.no_grad():
        for p in params:
            full = nn.Parameter(p.sharded_param.full_tensor(), requires_grad=p.requires_grad)
            if with_grads and p.sharded_param.grad is not None:
                full.grad = p.sharded_param.grad.full_tensor()
            if keep:
                summoned.append((p, full))
    try:
        for p, full in summoned:
            for module, name in p.owners:
                module._parameters[name] = full
        yield
    finally:
        with torch.no_grad():
            for p, full in summoned:
                if writeback:
                    p.local_shard.copy_(p.own_rows(p.tp_local(full.detach())))
                p.install(sharded=True)


def full_state_dict(model: nn.Module, rank0_only: bool = True, offload_to_cpu: bool = True) -> dict:
    """The unsharded model's `state_dict()`, gathered one parameter at a time.

    With `rank0_only`, ranks other than 0 get `{}`; with `offload_to_cpu`, values are on the CPU.
    It loads into an unsharded model with `load_state_dict`, and back with `load_full_state_dict`.
    """
    states = _states(model, "full_state_dict")
    _check_idle(states, "full_state_dict")
    keep = not rank0_only or dist.get_rank() == 0
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[key] = value.detach().cpu() if offload_to_cpu else value.detach().clone()
    return out


def full_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True, offload_to_cpu: bool = True
) -> dict:
    """The optimizer's state as an unsharded model's optimizer would hold it (keys are FQNs)."""
    states = _states(model, "full_optim_state_dict")
    _check_idle(states, "full_optim_state_dict")
    full = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu)
    )
    if offload_to_cpu:  # torch's helper already keeps only rank 0's copy
        return full
    return full if (not rank0_only or dist.get_rank() == 0) else {}


def load_full_state_dict(model: nn.Module, state_dict: Optional[dict], src: int = 0) -> None:
    """Load a full state dict that exists on rank `src` only (FSDP1's `sync_module_states`).

    Other ranks pass `None` (their model may come from the meta device and `to_empty`). Each
    sharded parameter is scattered, so a rank receives its own rows only; buffers are broadcast.
    """
    states = _states(model, "load_full_state_dict")
    _check_idle(states, "load_full_state_dict")
    rank = dist.get_rank()
    if rank == src and not isinstance(state_dict, dict):
        raise TypeError(f"load_full_state_dict: rank {src} must pass the full state dict, got {type(state_dict).__name__}")
    for state in states:
        if state.group is not None:
            state.group.reshard()
    by_param = {id(p.sharded_param): p for p in _sharded_params(states)}
    targets = model.state_dict(keep_vars=True)
    if rank == src:
        missing = sorted(set(targets) - set(state_dict))
        if missing:
            raise ValueError(f"load_full_state_dict: the state dict lacks {missing[:8]}; pass the model's full state_dict()")
    with torch.no_grad():
        for key, target in targets.items():
            full = state_dict[key] if rank == src else None
            sharded = by_param.get(id(target))
            if sharded is not None:
                if rank == src and tuple(full.shape) != tuple(sharded.orig_size):
                    raise ValueError(
                        f"load_full_state_dict: '{key}' has shape {tuple(full.shape)}, expected {tuple(sharded.orig_size)}"
                    )
                sharded.scatter_from(full, src)
            else:
                value = target.to_local() if isinstance(target, DTensor) else target
                if rank == src:
                    if tuple(full.shape) != tuple(value.shape):
                        raise ValueError(f"load_full_state_dict: '{key}' has shape {tuple(full.shape)}, expected {tuple(value.shape)}")
                    value.copy_(full)
                dist.broadcast(value, src=src)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them: `set_requires_gradient_sync(False)` on every
    group inside the block, the previous settings restored on exit."""
    states = _states(model, "no_sync")
    previous = [(s.group, s.group.requires_gradient_sync) for s in states if s.group is not None]
    for group, _ in previous:
        group.requires_gradient_sync = False
    try:
        yield
    finally:
        for group, value in previous:
            group.requires_gradient_sync = value


__all__ = [
    "full_optim_state_dict",
    "full_state_dict",
    "load_full_state_dict",
    "no_sync",
    "summon_full_params",
]
