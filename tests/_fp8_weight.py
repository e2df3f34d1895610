"""A small tensor subclass with FSDP2's all-gather extension, for tests: the weight is fp32, the
all-gather carries it as float8_e4m3fn (viewed as uint8, which gloo can move) with a per-tensor
scale fixed when the weight is wrapped (static scaling, so every rank scales alike)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max

_aten = torch.ops.aten
# Ops whose result is still the weight (a shard, a copy, a view of it): they keep the subclass, so
# sharding and moving the parameter keeps the hooks. Everything else computes on plain fp32.
_KEEP = {
    _aten.detach.default, _aten.clone.default, _aten.slice.Tensor, _aten.view.default,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten._to_copy.default, _aten.new_zeros.default,
    _aten.empty_like.default, _aten.alias.default, _aten.as_strided.default, _aten.narrow.default,
    _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten._unsafe_view.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, scale: float):
        self._data = data
        self._scale = scale

    @classmethod
    def wrap(cls, weight: torch.Tensor) -> "Fp8AllGatherWeight":
        return cls(weight.detach(), weight.detach().abs().max().item() / FP8_MAX * 2)

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._data}, scale={self._scale})"

    def __tensor_flatten__(self):
        return ["_data"], self._scale

    @staticmethod
    def __tensor_unflatten__(inner, scale, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_data"], scale)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scale = next(a._scale for a in tree_leaves(args) if isinstance(a, Fp8AllGatherWeight))
        unwrap = lambda t: t._data if isinstance(t, Fp8AllGatherWeight) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable:  # in place (optimizer steps, copy_): the wrapper is the result
            return args[0]
        if func in _KEEP:
            return tree_map(lambda t: cls(t, scale) if isinstance(t, torch.Tensor) else t, out)
        return out

    # FSDP2's all-gather extension (the signature torch 2.13 calls with five arguments)
    # FSDP2 hands the pre-hook this rank's unpadded shard: a rank with fewer rows pads its inputs.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = (self._data / self._scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        padded_rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] < padded_rows:
            data = torch.cat([data, data.new_zeros((padded_rows - data.shape[0], *data.shape[1:]))])
        return (data,), self._scale

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        full = data.view(FP8).to(param_dtype) * metadata
        if out is not None:
            # Refilling the parameter autograd saved for backward is not a change it should see
            # (the values are the ones forward used); torch's fully_shard leaves that to the hook.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full[: out.shape[0]])  # `out` is the parameter: the padded rows dropped
            return
        return full, (full,)
