"""Walking what users pass to and return from a sharded module's forward.

The eager hooks (runtime/state.py) and the traced hooks (traced/unshard.py) both cast and inspect
forward inputs and outputs; they share these helpers so the two modes see the same tensors.

[Note: Containers users return]
`torch.utils._pytree` only looks inside containers registered with it: an unregistered dataclass is a
leaf, so a forward returning `{"out": Out(logits)}` looked tensor-free, the root decided no backward
would come and resharded parameters autograd had saved. Here a container is anything users return
in practice: lists, tuples and namedtuples, dicts and their subclasses (Hugging Face's `ModelOutput`
is an `OrderedDict` and a dataclass), dataclasses (frozen ones too), and whatever else pytree knows.
Anything else (None, ints, strings, custom objects) is a leaf that is kept as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """A copy of `tree`'s containers with `fn` applied to every tensor in them; leaves stay as they are.

    Containers are always rebuilt, never compared by identity: Dynamo traces this too (traced/unshard.py).
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if type(tree) is dict:
        return {key: map_tensors(fn, value) for key, value in tree.items()}
    if isinstance(tree, dict):
        new = copy.copy(tree)  # keeps the subclass and, for ModelOutput, its attributes
        for key, value in tree.items():
            new[key] = map_tensors(fn, value)
        return new
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        new = copy.copy(tree)
        for field in dataclasses.fields(tree):
            if hasattr(tree, field.name):
                # Frozen dataclasses too, without running __init__ or __post_init__ again.
                object.__setattr__(new, field.name, map_tensors(fn, getattr(tree, field.name)))
        return new
    if isinstance(tree, (list, tuple)):
        items = [map_tensors(fn, value) for value in tree]
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
            return type(tree)(*items)
        return type(tree)(items)
    if type(tree) in pytree.SUPPORTED_NODES:
        children, spec = pytree.tree_flatten(tree, is_leaf=lambda x: x is not tree)
        return pytree.tree_unflatten([map_tensors(fn, child) for child in children], spec)
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in order; see [Note: Containers users return]."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(collect, tree)
    return found


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with every floating-point tensor not already of `dtype` cast to it."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map_tensors(cast, tree)
