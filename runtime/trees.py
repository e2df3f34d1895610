"""Walking what users pass to and return from a sharded module's forward.

The eager hooks (runtime/state.py) and the traced hooks (runtime/traced.py) both cast and inspect
forward inputs and outputs; they share these helpers so the two modes see the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with every floating-point tensor not already of `dtype` cast to it."""

    def cast(x):
        if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
