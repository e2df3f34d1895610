"""FSDP1-style communication hooks: replace a group's gradient reduce-scatter, e.g. to compress it.

A hook is `hook(state, grad, output, group)`: `grad` is the group's packed gradient (every rank's
slots, flat, in the reduce dtype), `output` this rank's slot to fill with the SUM over `group`.
fsdp_graph then all-reduces across replicas (HSDP) and divides by the data-parallel size, as it
does without a hook. Under `torch.compile(backend="fsdp_graph")` a group with a hook runs on the
eager runtime's hooks, logged as a fallback (traced/unshard.py, [Note: Groups that stay on the
eager hooks]).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..api import FSDPModule


def bf16_compress_hook(state: Any, grad: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Reduce-scatter in bf16 (half the bytes on the wire); the result lands in fp32 `output`."""
    reduced = torch.empty(output.shape, dtype=torch.bfloat16, device=output.device)
    dist.reduce_scatter_single(reduced, grad.to(torch.bfloat16), op=dist.ReduceOp.SUM, group=group)
    output.copy_(reduced)


def register_comm_hook(module: FSDPModule, state: Any, hook: Callable, *, recurse: bool = False) -> None:
    """Use `hook` (with `state` as its first argument) for the gradient reduction of `module`'s
    group, or of every group below it with `recurse=True`."""
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"register_comm_hook needs a module passed to fully_shard, got {type(module).__name__}"
        )
    if not callable(hook):
        raise TypeError(f"hook must be callable as hook(state, grad, output, group), got {hook!r}")
    bound = functools.partial(hook, state)
    for fsdp_state in module._states(recurse):
        if fsdp_state.group is not None:
            if fsdp_state.group.comm_hook is not None:
                raise ValueError(f"a comm hook is already registered on group '{fsdp_state.name}'; register one per group")
            fsdp_state.group.comm_hook = bound


__all__ = ["bf16_compress_hook", "register_comm_hook"]
