"""The autograd functions a traced unshard is made of: their forward gathers, their backward
reduce-scatters; and `fsdp_graph::gather_group`, the op that calls them for a plain bucket. They
know tensors, sizes and process group names, not groups or states: traced/unshard.py hands them a
group's parameters and its layout's fields. The copy-in, copy-out and gradient packing around them
are the registered ops of runtime/bucket_layout.py, which the eager runtime calls too. See [Note:
Traced unshard] in traced/unshard.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..runtime.bucket_layout import FLAGS  # and the fsdp_graph:: ops used below
from ..runtime.param import shard_dim_first

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
    """How `AllGatherRow`'s backward reduces the gathered row's gradient."""

    reduce_dtype: Optional[torch.dtype]  # the policy's reduce_dtype, None: the gradient's own
    row_dtype: torch.dtype  # the shards' dtype, which the reduced row is cast back to
    world: int
    reduce_group: str  # the shard group, or its separate reduce-scatter group
    replicate: Optional[str]  # HSDP: the replicate axis' group name; else None
    divide_factor: tuple[float, float]  # (pre, post), see `divide_factors` in collectives
    reduced_numel: int  # the columns a rank reduces: the trainable parameters', then the flags'
    flags_column: int  # where the flags' columns begin (the layout's `flags_at` is their block)


class CopyOut(NamedTuple):
    """The `fsdp_graph::copy_out` arguments after the gathered row: where each parameter's rows are."""

    world: int
    widths: list[int]
    numels: list[int]
    flags_at: int  # the flags' block (-1: none)


class AllGatherRow(torch.autograd.Function):
    """Forward: all-gather a group's shard buffer, the row its shards are views of ([Note: Traced
    gathers read the shard buffer] in traced/unshard.py), and copy each parameter out of it.
    Backward: pack the parameters' gradients and do what `AllGatherShards` does with the columns it
    reduces; the reduced row is the row's gradient (its frozen columns zeros), its flags' columns
    the flags' ([Note: Compiled gradients arrive as the row's] in runtime/shard_buffer.py). Where
    the forward used every trainable parameter, the flags get no gradient: [Note: Flags that need
    no reading] in traced/unshard.py.

    Arguments: the row (the buffer's gradient leaf, or the buffer itself where no parameter is
    trainable), the `RowGradients`, the all-gather's dtype and group name, the flags (None without
    trainable parameters), an input so that autograd hands them their gradient, and the `CopyOut`.
    """

    @staticmethod
    def forward(ctx, row, spec, all_gather_dtype, group_name, flags, copy):
        ctx.spec, ctx.copy = spec, copy
        ctx.row_numel = row.numel()
        # A parameter the forward did not use gets None, not zeros: its flag is 0 on this rank.
        ctx.set_materialize_grads(False)
        if spec.world == 1:  # [Note: One rank issues no collectives] in runtime/collectives.py
            gathered = row.to(all_gather_dtype, copy=True)
        else:
            gathered = C10D.wait_tensor(C10D.all_gather_into_tensor(row.to(all_gather_dtype), spec.world, group_name))
        ctx.gathered_dtype, ctx.device = gathered.dtype, gathered.device
        return tuple(torch.ops.fsdp_graph.copy_out(gathered, *copy))

    @staticmethod
    def backward(ctx, *grads):
        spec, copy = ctx.spec, ctx.copy
        grad = torch.ops.fsdp_graph.pack_grads(
            list(grads), copy.world, copy.widths, copy.numels, ctx.gathered_dtype, ctx.device, copy.flags_at
        )
        if grad.numel() != spec.world * spec.reduced_numel:  # leave the frozen columns out
            grad = grad.view(spec.world, -1)[:, : spec.reduced_numel].contiguous().view(-1)
        reduced = _reduce_scatter(
            grad.to(spec.reduce_dtype or grad.dtype), spec.world, spec.reduce_group, spec.replicate, spec.divide_factor
        ).to(spec.row_dtype)
        every_grad_given = copy.flags_at < 0 or all(g is not None for g in grads[: copy.flags_at])
        # One flag per trainable parameter, before the flags' block's padding column.
        flags = None if every_grad_given else reduced[spec.flags_column : spec.flags_column + copy.flags_at]
        if reduced.numel() < ctx.row_numel:  # the frozen parameters' columns get no gradient
            reduced = F.pad(reduced, (0, ctx.row_numel - reduced.numel()))
        return reduced, None, None, None, flags, None


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
        flags = flags[:num]  # one per parameter, before the padding column
        shard_grads = [
            shard[:valid_numel].to(dtype) for shard, valid_numel, dtype in zip(shards, b.valid_numels, b.shard_dtypes)
        ]
        return (None, flags, *shard_grads, *([None] * num))


@torch._dynamo.nonstrict_trace
def route_gradients(bucket: GradientBucket, flags: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`RouteGradients.apply`, which Dynamo leaves for AOTAutograd to trace."""
    return RouteGradients.apply(bucket, flags, *tensors)


# [Note: A group's gather is one op to Dynamo]
# Dynamo steps through every bytecode instruction of every layer's hooks, with a variable for each
# value and a fake tensor for each op: it stepped through the whole gather in every layer (the
# shards' flat views, the autograd Function's arguments, the copy-out's views), and speculated
# `AllGatherRow`'s backward in every layer. So the gather of a plain bucket is one
# registered op, `fsdp_graph::gather_group`, whose only kernel is CompositeImplicitAutograd: Dynamo
# puts one node in its graph and runs the kernel on fake tensors for the outputs' sizes, without
# tracing it, and AOTAutograd, which traces below autograd, runs the kernel and records what it
# calls: `AllGatherRow` (or, without a shard buffer, the shards' views, the copy-in and
# `AllGatherShards`) with its collectives and backward, the copy-out and the parameters' views.
# The joint graph is the one Dynamo's trace of the same Python gave. The kernel reads only its
# arguments (tensors, ints, names), so Dynamo's guards on what the traced hook reads are unchanged;
# the annotation around the call reaches every node AOTAutograd records for it, the backward's too.
# The compile caches key Dynamo's graph, which names the op but holds no kernel: the kernel is among
# our sources, whose digest is in our passes' keys ([Note: Rank-independent cache keys] in
# fsdp_graph/compile/cache_key.py).
_GATHER = torch.library.Library("fsdp_graph", "FRAGMENT")
_GATHER.define(
    "gather_group(Tensor[] params, Tensor? flags, Tensor? row, int world, int[] blocks, int[] widths, int[] numels, "
    "int[] reduce_offsets, int[] shard_dims, int[] moved_sizes, ScalarType dtype, "
    "str group_name, str reduce_group, str? replicate, float[] divide_factor, ScalarType? reduce_dtype) -> Tensor[]"
)


@torch.library.impl(_GATHER, "gather_group", "CompositeImplicitAutograd")
def gather_group(
    params: list[torch.Tensor],
    flags: Optional[torch.Tensor],
    row: Optional[torch.Tensor],
    world: int,
    blocks: list[int],
    widths: list[int],
    numels: list[int],
    reduce_offsets: list[int],
    shard_dims: list[int],
    moved_sizes: list[int],
    dtype: torch.dtype,
    group_name: str,
    reduce_group: str,
    replicate: Optional[str],
    divide_factor: list[float],
    reduce_dtype: Optional[torch.dtype],
) -> list[torch.Tensor]:
    """A plain bucket's traced gather: one unsharded tensor per parameter, as the module computes
    with it (tp-local), from its `BucketLayout`'s fields of the same names and either `row`, the
    group's shard buffer (or its gradient leaf), which the parameters are views of ([Note: Traced
    gathers read the shard buffer] in traced/unshard.py), with `params` empty; or, with `row` None,
    the group's sharded parameters (`params`, DTensors, in group order), copied in. `flags`: the
    flags leaf, None without trainable parameters. See [Note: A group's gather is one op to Dynamo]."""
    flags_at = blocks.index(FLAGS) if FLAGS in blocks else -1
    reduced = blocks[:flags_at] if flags_at >= 0 else []
    dtypes = {p.dtype for p in params} if row is None else {row.dtype}
    flat_dtype = dtypes.pop() if len(dtypes) == 1 else dtype
    if flags is not None:  # [Note: Gradient flags in a graph] in traced/unshard.py
        flags = (flags if len(reduced) == flags.numel() else flags[reduced]).to(flat_dtype)
    copy = CopyOut(world, list(widths), list(numels), flags_at)
    sizes = _split_sizes(moved_sizes)
    if row is not None:
        reduced_numel, flags_column = (reduce_offsets[-1], reduce_offsets[-2]) if reduced else (0, 0)
        spec = RowGradients(
            reduce_dtype, row.dtype, world, reduce_group, replicate, tuple(divide_factor), reduced_numel, flags_column
        )
        outputs = AllGatherRow.apply(row, spec, dtype, group_name, flags, copy)
    else:
        shards = [shard_dim_first(p.to_local(), d).reshape(-1) for p, d in zip(params, shard_dims)]
        pieces = [flags if i == FLAGS else shards[i].to(flat_dtype) for i in blocks]
        num_reduced = flags_at + 1 if flags is not None else len(blocks)
        gathered = AllGatherShards.apply(
            _flat_row(pieces[:num_reduced], widths[:num_reduced]),
            _flat_row(pieces[num_reduced:], widths[num_reduced:]) if num_reduced < len(pieces) else None,
            dtype, reduce_dtype, world, group_name, replicate, tuple(divide_factor), reduce_group,
        )
        if flags is None and len(params) == 1:  # the rows are the padded parameter: a view, no copy
            (size,), (width,) = sizes, widths
            row_numel = math.prod(size[1:])
            rows = gathered.view(world * width // row_numel if row_numel else size[0], *size[1:])[: size[0]]
            return [to_param_layout(rows, shard_dims[0])]
        outputs = torch.ops.fsdp_graph.copy_out(gathered, *copy)
    return [
        to_param_layout(outputs[blocks.index(i)].view(size), shard_dim)
        for i, (size, shard_dim) in enumerate(zip(sizes, shard_dims))
    ]


def to_param_layout(rows: torch.Tensor, shard_dim: int) -> torch.Tensor:
    """The gathered rows (shard dim first) as the parameter: for a shard dim k > 0 moved back and
    made contiguous, as eager's copy-out does ([Note: Sharding on another dim] in runtime/param.py)."""
    return rows if shard_dim == 0 else rows.movedim(0, shard_dim).contiguous()


def _split_sizes(moved_sizes: list[int]) -> list[list[int]]:
    """`BucketLayout.moved_sizes` apart: per parameter, its rank, then its size."""
    sizes, at = [], 0
    while at < len(moved_sizes):
        rank = moved_sizes[at]
        sizes.append(moved_sizes[at + 1 : at + 1 + rank])
        at += 1 + rank
    return sizes


def _flat_row(pieces: list[torch.Tensor], widths: list[int]) -> torch.Tensor:
    """`pieces` zero-padded to `widths` and laid end to end with `fsdp_graph::copy_in`; a single
    piece is padded in place of the op, or, already as wide, is the row itself (no copy)."""
    if len(pieces) > 1:
        return torch.ops.fsdp_graph.copy_in(pieces, list(widths))
    (piece,), (width,) = pieces, widths
    return F.pad(piece, (0, width - piece.numel())) if piece.numel() < width else piece
