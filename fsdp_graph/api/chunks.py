"""`run_in_chunks`: a module's forward run on slices of its inputs, one after the other.

Expert parallelism sends a MoE layer's tokens to their experts' ranks and back (two all-to-alls),
and the experts cannot start before their tokens arrive. Run on two halves of the tokens instead,
the second half's tokens can travel while the first half's experts compute, and the first half's
results travel back while the second half's experts compute. In eager mode the halves run one after
the other, with the numbers of the whole (up to the order of the sums over tokens in the weights'
gradients). Under `torch.compile(backend="fsdp_graph")`, each half's nodes carry its index
(`CHUNK_KEY`, through `torch.fx.traceback.annotate`, into the backward too), and the pass
`overlap_all_to_alls` (passes/ep_overlap.py) issues the halves' all-to-alls in pairs.

Only for a module whose output at a position of `dim` depends on its inputs at that position alone
(a MoE layer or an MLP over tokens; not attention along the sequence), and whose side effects add
up over the slices (torchtitan's routers count tokens per expert into a buffer: the counts add up).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..passes.nodes import CHUNK_KEY


def run_in_chunks(module: nn.Module, chunks: int = 2, dim: int = 0) -> nn.Module:
    """Make `module` run its forward on `chunks` slices along `dim` of every tensor argument that
    has the first tensor argument's size there (each slice contiguous), the others passed whole,
    and concatenate the outputs (tensors, or tuples and lists of them) along `dim`. Returns
    `module`, changed in place (its class becomes a subclass, `Chunked<Cls>`, as `fully_shard`
    makes `FSDP<Cls>`; unchanged for `chunks=1`); call it before or after `fully_shard`: the FSDP
    hooks run once around the slices. Fewer positions than `chunks` make fewer slices."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"run_in_chunks takes an nn.Module, got {type(module).__name__}")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"run_in_chunks: chunks must be a positive int, got {chunks!r}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"run_in_chunks: dim must be an int, got {type(dim).__name__}")
    if isinstance(module, _Chunked):
        raise ValueError(f"run_in_chunks: this {type(module).__name__} already runs in "
                         f"{module._fsdp_graph_chunks[0]} chunks; call it once per module")
    if chunks == 1:
        return module
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Chunked{cls.__name__}", (_Chunked, cls), {})
    module.__class__ = _CLASSES[cls]
    module._fsdp_graph_chunks = (chunks, dim)
    if "forward" in module.__dict__:  # a forward set on the instance (torchtitan's redistribution wrapper)
        module._fsdp_graph_inner_forward = module.__dict__.pop("forward")
    return module


class _Chunked:
    """The forward of a module `run_in_chunks` changed; the class's own forward runs each slice.
    A class rather than a function on the instance: a copy of the module (`copy.deepcopy`) runs
    its own forward, not the original's. A forward the instance had of its own runs each slice
    in its place."""

    _fsdp_graph_chunks: tuple[int, int]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        whole = self.__dict__.get("_fsdp_graph_inner_forward") or super().forward
        chunks, dim = self._fsdp_graph_chunks
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors:
            return whole(*args, **kwargs)
        if not -tensors[0].dim() <= dim < tensors[0].dim():
            raise ValueError(f"run_in_chunks: {type(self).__name__}'s first tensor argument has "
                             f"{tensors[0].dim()} dims, no dim {dim} to slice; pass the dim of its tokens")
        size = tensors[0].shape[dim]
        pieces = min(chunks, size)
        if pieces < 2:
            return whole(*args, **kwargs)

        def cut(value: Any, k: int) -> Any:
            if isinstance(value, torch.Tensor) and -value.dim() <= dim < value.dim() and value.shape[dim] == size:
                return value.tensor_split(pieces, dim=dim)[k].contiguous()  # a model may view it
            return value

        outputs = []
        for k in range(pieces):
            with torch.fx.traceback.annotate({CHUNK_KEY: k}):
                outputs.append(whole(*(cut(a, k) for a in args), **{n: cut(v, k) for n, v in kwargs.items()}))
        return _concatenated(outputs, dim, type(self).__name__)


_CLASSES: dict[type, type] = {}


def _concatenated(outputs: list[Any], dim: int, owner: str) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=dim)
    if isinstance(first, (tuple, list)) and all(type(o) is type(first) and len(o) == len(first) for o in outputs):
        return type(first)(_concatenated([o[i] for o in outputs], dim, owner) for i in range(len(first)))
    raise TypeError(f"run_in_chunks: {owner}'s forward returned {type(first).__name__}; only tensors, "
                    "or tuples and lists of them, can be put together from the chunks")
