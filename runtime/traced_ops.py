"""The autograd functions a traced unshard is made of: their forward gathers, their backward
reduce-scatters. They know tensors, sizes and process group names, not groups or states:
runtime/traced.py builds them from a group and its layout. The copy-in, copy-out and gradient
packing around them are the registered ops of runtime/bucket_layout.py, which the eager runtime
calls too. See [Note: Traced unshard] in runtime/traced.py.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import bucket_layout  # noqa: F401  the fsdp_graph:: ops used below

C10D = torch.ops._c10d_functional


class AllGatherShards(torch.autograd.Function):
    """Forward: all-gather a flat bucket. Backward: reduce-scatter (SUM) its gradient and divide.

    The bucket is `trainable` then `frozen` (None when the group has no frozen parameters): frozen
    parameters are gathered with the rest but get no gradient, and their columns are left out of
    the reduce-scatter, as the eager runtime leaves them out of its bucket.
    Both directions are functional collectives followed by `wait_tensor`, so they are graph nodes
    that passes can move. See [Note: Traced unshard].
    """

    @staticmethod
    def forward(
        ctx, trainable, frozen, all_gather_dtype, reduce_dtype, world, group_name, replicate, divide_factor, reduce_group
    ):
        ctx.reduce_dtype = reduce_dtype
        ctx.flat_dtype = trainable.dtype
        ctx.world = world
        ctx.reduce_group = reduce_group  # the shard group, or its separate reduce-scatter group
        ctx.replicate = replicate  # HSDP: the replicate axis' group name; else None
        ctx.divide_factor = divide_factor
        ctx.trainable_numel = trainable.numel()
        flat = trainable if frozen is None else torch.cat([trainable, frozen])
        if world == 1:  # [Note: One rank issues no collectives] in runtime/collectives.py
            return flat.to(all_gather_dtype, copy=True)
        gathered = C10D.all_gather_into_tensor(flat.to(all_gather_dtype), world, group_name)
        return C10D.wait_tensor(gathered)

    @staticmethod
    def backward(ctx, grad):
        if grad.numel() != ctx.world * ctx.trainable_numel:  # leave the frozen columns out
            grad = grad.view(ctx.world, -1)[:, : ctx.trainable_numel].contiguous().view(-1)
        reduced = _reduce_scatter(
            grad.to(ctx.reduce_dtype or grad.dtype), ctx.world, ctx.reduce_group, ctx.replicate, ctx.divide_factor
        )
        return reduced.to(ctx.flat_dtype), None, None, None, None, None, None, None, None


class RowGradients(NamedTuple):
    """How `AllGatherRow`'s backward hands the reduced row to the shards."""

    reduce_dtype: Optional[torch.dtype]  # the policy's reduce_dtype, None: the gradient's own
    row_dtype: torch.dtype  # the shards' dtype, which their gradients are cast back to
    world: int
    reduce_group: str  # the shard group, or its separate reduce-scatter group
    replicate: Optional[str]  # HSDP: the replicate axis' group name; else None
    divide_factor: tuple[float, float]  # (pre, post), see `divide_factors` in collectives
    reduce_offsets: tuple[int, ...]  # where each reduced block starts (the flags' last), then the row's end
    valid_numels: tuple[int, ...]  # per trainable shard: its elements, padding excluded


class AllGatherRow(torch.autograd.Function):
    """Forward: all-gather a group's shard buffer, the row its shards are views of ([Note: Traced
    gathers read the shard buffer] in runtime/traced.py). Backward: what `AllGatherShards` does
    with the columns it reduces, then each trainable shard's piece of the reduced row, and the
    flags', as their gradients.

    Arguments: the row, the `RowGradients`, the all-gather's dtype and group name, the flags (None
    without trainable parameters), then the trainable parameters' flat shards in the layout's
    order. The forward reads only the row: the flags and shards are inputs so that autograd hands
    them their gradients (the row, a buffer, gets none).
    """

    @staticmethod
    def forward(ctx, row, spec, all_gather_dtype, group_name, flags, *shards):
        ctx.spec = spec
        if spec.world == 1:  # [Note: One rank issues no collectives] in runtime/collectives.py
            return row.to(all_gather_dtype, copy=True)
        return C10D.wait_tensor(C10D.all_gather_into_tensor(row.to(all_gather_dtype), spec.world, group_name))

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        reduced_numel = spec.reduce_offsets[-1]
        if grad.numel() != spec.world * reduced_numel:  # leave the frozen columns out
            grad = grad.view(spec.world, -1)[:, :reduced_numel].contiguous().view(-1)
        reduced = _reduce_scatter(
            grad.to(spec.reduce_dtype or grad.dtype), spec.world, spec.reduce_group, spec.replicate, spec.divide_factor
        ).to(spec.row_dtype)
        # Each shard's valid elements and the flags, as slices: the copy-in's backward, for a row
        # that was never copied.
        *offsets, flags_at, end = spec.reduce_offsets  # precomputed: Dynamo traces this in every layer
        shard_grads = [reduced[offset : offset + numel] for offset, numel in zip(offsets, spec.valid_numels)]
        flags = reduced[flags_at:end]
        return None, None, None, None, flags, *shard_grads


def _reduce_scatter(
    grad: torch.Tensor, world: int, reduce_group: str, replicate: Optional[str], divide_factor: tuple[float, float]
) -> torch.Tensor:
    """What `collectives.reduce_scatter` does to a packed gradient bucket, as graph nodes: divide by
    `pre`, reduce-scatter with SUM, all-reduce over the replicate axis (HSDP), divide by `post`."""
    pre, post = divide_factor  # [Note: fp16 divides before and after the sum] in collectives
    grad = grad.contiguous()
    if pre != 1:
        grad = grad / pre
    if world == 1:  # [Note: One rank issues no collectives] in runtime/collectives.py
        reduced = grad
    else:
        reduced = C10D.wait_tensor(C10D.reduce_scatter_tensor(grad, "sum", world, reduce_group))
    if replicate is not None:
        reduced = C10D.wait_tensor(C10D.all_reduce(reduced, "sum", replicate))
    return reduced / post


class GradientBucket(NamedTuple):
    """The reduce-scatter bucket of a group's trainable parameters, as `RouteGradients` packs it.
    Only values an FX node takes as arguments, so `route_gradients` can be handed it (no None)."""

    world: int
    shard_numels: tuple[int, ...]  # per block: its columns, padding included (`BucketLayout.reduce_widths`)
    numels: tuple[int, ...]  # per block: its unsharded elements, 0 for the flags (`reduce_numels`)
    valid_numels: tuple[int, ...]  # per parameter: this rank's shard's elements, padding excluded
    shard_dtypes: tuple[torch.dtype, ...]  # per parameter: its shard's gradient's dtype
    reduce_dtype: torch.dtype
    device: torch.device
    reduce_group: str  # the process group names of the reduce-scatter ...
    replicate_group: str  # ... and of the HSDP all-reduce, "" without one
    divide_factor: tuple[float, float]  # (pre, post), see `divide_factors`


class RouteGradients(torch.autograd.Function):
    """Forward: the rebuilt unsharded parameters, as they are. Backward: their gradients packed,
    reduce-scattered and divided, as each shard's gradient. See [Note: Traced all-gather extensions].

    Arguments: the `GradientBucket`, the flags, then one flat shard per trainable parameter, then
    the unsharded tensors in the same order (shard dim first).
    """

    @staticmethod
    def forward(ctx, bucket, flags, *tensors):
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None: flagged 0
        num = len(tensors) // 2
        return tuple(t.view_as(t) for t in tensors[num:])

    @staticmethod
    def backward(ctx, *grads):
        b, num = ctx.bucket, len(grads)
        packed = torch.ops.fsdp_graph.pack_grads(
            [*grads, None], b.world, b.shard_numels, b.numels, b.reduce_dtype, b.device, num
        )
        reduced = _reduce_scatter(packed, b.world, b.reduce_group, b.replicate_group or None, b.divide_factor)
        *shards, flags = reduced.split(b.shard_numels)
        shard_grads = [
            shard[:valid_numel].to(dtype) for shard, valid_numel, dtype in zip(shards, b.valid_numels, b.shard_dtypes)
        ]
        return (None, flags, *shard_grads, *([None] * num))


@torch._dynamo.nonstrict_trace
def route_gradients(bucket: GradientBucket, flags: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`RouteGradients.apply`, which Dynamo leaves for AOTAutograd to trace."""
    return RouteGradients.apply(bucket, flags, *tensors)
