"""The call check on a submodule whose parameters a `fully_shard` group holds: called on its own, it
would see DTensor shards instead of gathered parameters, so `FSDPState._check_called_through_group`
raises, naming the fix. Callers that know the group is gathered may lift it for a while.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn


class OwnerCheck:
    """The call check (`FSDPState._check_called_through_group`) on one submodule, which callers
    may lift for a while; lifts are counted, so nested ones put the check back once, at the last."""

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

    def __init__(self, owner: nn.Module, check: Callable) -> None:
        self.owner, self.check = owner, check
        self.handle = owner.register_forward_pre_hook(check)
        self.lifts = 0

    def is_only_hook(self) -> bool:
        """Whether the module has no hook but this check (which may be lifted already)."""
        hooks = sum(len(getattr(self.owner, name)) for name in self._HOOK_DICTS)
        return hooks == (1 if self.lifts == 0 else 0)

    def lift(self) -> None:
        self.lifts += 1
        if self.lifts == 1:
            self.handle.remove()

    def restore(self) -> None:
        self.lifts -= 1
        if self.lifts == 0:
            self.handle = self.owner.register_forward_pre_hook(self.check)
