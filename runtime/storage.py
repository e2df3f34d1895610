"""A tensor's storage as the runtime manages it: freed by resizing it to 0 bytes, refilled before reuse.

Unsharded parameters and the all-gather extensions' buffers keep their tensor objects across steps
(autograd saved them) while their bytes come and go; `refill` gives the bytes back. `contiguous_stride`
is the stride DTensors are built with, so a shard's global view is a contiguous tensor.
"""

from __future__ import annotations

import torch


def refill(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (resized to 0) its bytes back."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
