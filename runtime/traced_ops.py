"""The tensor operations a traced unshard is made of: copy-in, copy-out and gradient packing as
custom ops (one ATen call each under Inductor), and the autograd functions whose forward gathers
and whose backward reduce-scatters. They know tensors, sizes and process group names, not groups or
states: runtime/traced.py builds them from a group. See [Note: Traced unshard] there.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

C10D = torch.ops._c10d_functional


# -- copy-in, copy-out and copy-out's gradient, as custom ops (see [Note: Traced unshard]) --------


@torch.library.custom_op("fsdp_graph::copy_in", mutates_args=())
def copy_in(shards: list[torch.Tensor], shard_numels: list[int]) -> torch.Tensor:
    """This rank's row of the bucket: each flat shard, zero-padded to `shard_numels[i]`, in order."""
    flat = shards[0].new_empty(sum(shard_numels))
    offset = 0
    for shard, shard_numel in zip(shards, shard_numels):
        flat[offset : offset + shard.numel()].copy_(shard)
        flat[offset + shard.numel() : offset + shard_numel].zero_()
        offset += shard_numel
    return flat


@copy_in.register_fake
def _(shards, shard_numels):
    return shards[0].new_empty(sum(shard_numels))


def _copy_in_setup(ctx, inputs, output):
    shards, shard_numels = inputs
    ctx.layout = ([s.numel() for s in shards], shard_numels)


def _copy_in_backward(ctx, grad):
    numels, shard_numels = ctx.layout
    offsets = [sum(shard_numels[:i]) for i in range(len(shard_numels))]
    return [grad[offset : offset + numel] for offset, numel in zip(offsets, numels)], None


copy_in.register_autograd(_copy_in_backward, setup_context=_copy_in_setup)


@torch.library.custom_op("fsdp_graph::copy_out", mutates_args=())
def copy_out(
    gathered: torch.Tensor, world: int, shard_numels: list[int], numels: list[int], flags_at: int
) -> list[torch.Tensor]:
    """Each parameter's `numels[i]` leading elements of its columns of the gathered bucket, flat.

    `gathered` is (world * sum(shard_numels),): rank r's row holds every parameter's shard, padded
    to `shard_numels[i]`. Parameter i is the concatenation of its column block over the rows, so
    its first `numels[i]` elements are the unpadded parameter. Block `flags_at` (-1: none) holds the
    gradient flags, not a parameter: its output has no elements (`numels[flags_at]` is 0).
    """
    rows = gathered.view(world, -1)
    out, offset = [], 0
    for shard_numel, numel in zip(shard_numels, numels):
        full = torch.empty(world * shard_numel, dtype=gathered.dtype, device=gathered.device)
        full.view(world, shard_numel).copy_(rows[:, offset : offset + shard_numel])
        out.append(full[:numel])
        offset += shard_numel
    return out


@copy_out.register_fake
def _(gathered, world, shard_numels, numels, flags_at):
    return [gathered.new_empty(numel) for numel in numels]


@torch.library.custom_op("fsdp_graph::pack_grads", mutates_args=())
def pack_grads(
    grads: list[Optional[torch.Tensor]],
    world: int,
    shard_numels: list[int],
    numels: list[int],
    dtype: torch.dtype,
    device: torch.device,
    flags_at: int,
) -> torch.Tensor:
    """The inverse layout of `copy_out`: a gathered-shaped bucket with each gradient in its
    parameter's columns; zeros for padding and for a missing gradient. Block `flags_at` (-1: none)
    gets, in every row, one flag per gradient before it: 1 where it is not None (see
    [Note: Gradient flags in a graph])."""
    packed = torch.empty(world, sum(shard_numels), dtype=dtype, device=device)
    offset = 0
    for i, (grad, shard_numel, numel) in enumerate(zip(grads, shard_numels, numels)):
        # The gradient fills the block (world, shard_numel) row by row; the rest is padding.
        block = packed[:, offset : offset + shard_numel]
        offset += shard_numel
        if i == flags_at:
            flags = torch.tensor([float(g is not None) for g in grads[:i]], dtype=dtype, device=device)
            block.copy_(flags.expand(world, -1))
            continue
        if grad is None or numel == 0:
            block.zero_()
            continue
        flat = grad.reshape(-1)
        full_rows, rest = divmod(numel, shard_numel)
        if full_rows:
            block[:full_rows].copy_(flat[: full_rows * shard_numel].view(full_rows, shard_numel))
        if rest:
            block[full_rows, :rest].copy_(flat[full_rows * shard_numel :])
            block[full_rows, rest:].zero_()
            full_rows += 1
        block[full_rows:].zero_()
    return packed.view(-1)


@pack_grads.register_fake
def _(grads, world, shard_numels, numels, dtype, device, flags_at):
    return torch.empty(world * sum(shard_numels), dtype=dtype, device=device)


def _copy_out_setup(ctx, inputs, output):
    gathered, world, shard_numels, numels, flags_at = inputs
    # No tensor is saved: the gradient's layout is all the backward needs.
    ctx.layout = (world, shard_numels, numels, gathered.dtype, gathered.device, flags_at)
    # An output the forward did not use gets None, not zeros: pack_grads flags it.
    ctx.set_materialize_grads(False)


def _copy_out_backward(ctx, grads):
    packed = torch.ops.fsdp_graph.pack_grads(list(grads), *ctx.layout)
    return packed, None, None, None, None


copy_out.register_autograd(_copy_out_backward, setup_context=_copy_out_setup)


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
    shard_numels: tuple[int, ...]  # per parameter: its columns, padding included
    numels: tuple[int, ...]  # per parameter: its unsharded elements
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
            [*grads, None], b.world, [*b.shard_numels, num], [*b.numels, 0], b.reduce_dtype, b.device, num
        )
        reduced = _reduce_scatter(packed, b.world, b.reduce_group, b.replicate_group or None, b.divide_factor)
        shard_grads, offset = [], 0
        for shard_numel, valid_numel, dtype in zip(b.shard_numels, b.valid_numels, b.shard_dtypes):
            shard_grads.append(reduced[offset : offset + valid_numel].to(dtype))
            offset += shard_numel
        return (None, reduced[offset : offset + num], *shard_grads, *([None] * num))


@torch._dynamo.nonstrict_trace
def route_gradients(bucket: GradientBucket, flags: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`RouteGradients.apply`, which Dynamo leaves for AOTAutograd to trace."""
    return RouteGradients.apply(bucket, flags, *tensors)
