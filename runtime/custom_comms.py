"""The custom communication interfaces of `set_custom_all_gather` / `set_custom_reduce_scatter`:
what a user implements to replace a collective. The eager runtime's own bucketed collectives, which
call these where set, are runtime/collectives.py.

The same shape as FSDP2's `AllGather` / `ReduceScatter`: `allocate` makes the buffer the collective
uses (so a comm can hand out memory its backend registered), `__call__` runs it. Objects written
for FSDP2 work here unchanged (duck typing); these classes are for new ones.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch
import torch.distributed as dist


class Comm(ABC):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer for a collective's input or output; override to allocate elsewhere."""
        return torch.empty(*size, dtype=dtype, device=device)


class AllGather(Comm):
    @abstractmethod
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Optional[dist.Work]:
        """Gather every rank's `input_tensor` into `output_tensor` (rank order); a Work if async."""


class ReduceScatter(Comm):
    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        """Reduce `input_tensor` over ranks with `op`, this rank's slice into `output_tensor`."""


class ProcessGroupAllocator(Comm):
    """Collective buffers from `group`'s own allocator where its backend has one (NCCL's, which
    registers them for zero-copy transfers), else from the caching allocator, as FSDP2 does for
    `set_allocate_memory_from_process_group_for_comm(True)`. Gloo has none."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self.group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device).view(*size)
        return torch.empty(*size, dtype=dtype, device=device)


def has_own_allocator(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `group`'s backend allocates tensors itself on `device` (NCCL can; gloo cannot)."""
    backend = group._get_backend(device)
    return bool(getattr(backend, "supports_tensor_alloc", None)) and backend.supports_tensor_alloc(device)
