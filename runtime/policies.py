"""Policies that configure how `fully_shard` stores, casts and moves parameters.

They mirror FSDP2's policies field for field, so a script can swap imports. Each one is a frozen
dataclass that validates itself on construction: a bad field fails where it was written, not at the
first forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


def _check_dtype(policy: object, name: str) -> None:
    value = getattr(policy, name)
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(
            f"{type(policy).__name__}.{name} must be a torch.dtype or None, got {value!r} "
            f"({type(value).__name__}); pass e.g. {name}=torch.bfloat16"
        )
    if value is not None and not value.is_floating_point:
        raise ValueError(
            f"{type(policy).__name__}.{name}={value} is not a floating-point dtype; "
            f"use torch.float32, torch.bfloat16 or torch.float16"
        )


def _check_bool(policy: object, name: str) -> None:
    value = getattr(policy, name)
    if not isinstance(value, bool):
        raise TypeError(
            f"{type(policy).__name__}.{name} must be a bool, got {value!r} ({type(value).__name__})"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes the unsharded parameters, the gradient reduction and the outputs use.

    Attributes:
        param_dtype: dtype of the all-gather and of the unsharded parameters used in forward and
            backward. ``None`` keeps the sharded parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter. ``None`` uses ``param_dtype`` (or the
            parameters' dtype when that is ``None`` too).
        output_dtype: dtype the module's floating-point outputs are cast to. ``None`` leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(self, name)
        _check_bool(self, "cast_forward_inputs")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device.

    Attributes:
        (none) This base class is the "off" setting; see `CPUOffloadPolicy`.
    """

    def __post_init__(self) -> None:
        for field in fields(self):
            if field.type in ("bool", bool):
                _check_bool(self, field.name)


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; the optimizer steps there.

    Attributes:
        pin_memory: pin the CPU shards so host-to-device copies can overlap compute on CUDA.
    """

    pin_memory: bool = True
