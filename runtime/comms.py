"""The custom communication interfaces of `set_custom_all_gather` / `set_custom_reduce_scatter`.

The same shape as FSDP2's `AllGather` / `ReduceScatter`: `allocate` makes the buffer the collective
uses (so a comm can hand out memory its backend registered), `__call__` runs it. Objects written
for FSDP2 work here unchanged (duck typing); these classes are for new ones.
"""

from __future__ import annotations

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
