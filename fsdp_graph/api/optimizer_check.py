"""The optimizer step pre-hook `fully_shard` installs once per process: it refuses an optimizer
that holds replaced parameters or unreduced gradients, and reshards gathered groups before a step."""

from __future__ import annotations

import functools

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.param import OWNER_ATTR


@functools.lru_cache(maxsize=None)
def _install_optimizer_check() -> None:
    """Register `_before_optimizer_step` before every optimizer step, once per process.

    [Note: Optimizer built before fully_shard]
    `fully_shard` replaces each parameter on its module with a new DTensor shard. An optimizer built
    earlier holds the replaced parameters: they never get a gradient, so its `step()` silently does
    nothing. An optimizer instance cannot be reached from the module, so a global step pre-hook
    checks every optimizer's parameters instead (a dict lookup per parameter and step). It also
    catches a step taken while gradients are still unreduced or in flight.

    [Note: An optimizer step makes gathered parameters stale]
    A group still gathered at a step (`set_reshard_after_backward(False)`, or `unshard()` before
    the step) holds copies of the shards the step is about to change, and its next pre-forward would
    reuse them: one forward and backward on the old values, silently. torch's FSDP2 does exactly
    that. So the step reshards every group it updates, and the next forward gathers the new values;
    the gathered copies it frees could not have been reused correctly. This also keeps a compiled
    step after it consistent: traced groups read the shards, and `named_parameters()` shows the
    shards again instead of a stale gathered copy with no gradient.
    """
    register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """See [Note: Optimizer built before fully_shard] and [Note: An optimizer step makes gathered
    parameters stale]."""
    stale, unreduced = [], []
    contexts, groups = {}, {}  # by id, so the check stays linear in the number of parameters
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            owner = p.__dict__.get(OWNER_ATTR)
            if owner is None:
                continue
            if p is not owner.sharded_param:
                stale.append(owner.fqn)
            elif owner.unreduced_grad is not None or owner.has_unsharded_grad:
                unreduced.append(owner.fqn)
            state = owner.group_modules[0]._fsdp_state
            contexts.setdefault(id(state.ctx), state.ctx)
            groups.setdefault(id(state.group), state.group)
    if stale:
        raise ValueError(
            f"{type(optimizer).__name__} holds parameters that fully_shard (or a later "
            f"load_state_dict(assign=True)) replaced, e.g. {stale[:3]}; they never get gradients. "
            f"Build the optimizer after fully_shard: optimizer = {type(optimizer).__name__}"
            f"(model.parameters(), ...)"
        )
    if unreduced:
        raise ValueError(
            f"{type(optimizer).__name__}.step() was called while gradients of {unreduced[:3]} are "
            f"not reduced yet (set_requires_gradient_sync(False) in the last backward); call "
            f"model.set_requires_gradient_sync(True) before the last micro-batch's backward"
        )
    if any(ctx.comm.pending_reduce_scatters for ctx in contexts.values()):
        raise ValueError(
            f"{type(optimizer).__name__}.step() was called while gradient reduce-scatters are still "
            f"in flight (set_is_last_backward(False)); call model.set_is_last_backward(True) before "
            f"the step's last backward"
        )
    for group in groups.values():  # [Note: An optimizer step makes gathered parameters stale]
        group.reshard()
