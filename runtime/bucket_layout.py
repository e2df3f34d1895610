"""Where a group's parameters lie in its all-gather and reduce-scatter buckets, and the registered
ops that put them there: one `BucketLayout` per group, one implementation of each copy.

[Note: One bucket layout for eager and traced steps]
Ranks may run one group on different paths in the same step: traced in a graph on one rank, on the
eager hooks on another (a recompile limit or a graph break reached on one rank only, see
[Note: Fallback to the eager hooks] in traced/hooks.py). Both paths therefore put the same bytes
on the wire, by construction: each group has one `BucketLayout`, which both read, and the bytes are
moved by three registered ops, which both call:

    fsdp_graph::copy_in     this rank's shards -> its row of the all-gather
    fsdp_graph::copy_out    the gathered rows -> each block's (world, width) columns
    fsdp_graph::pack_grads  unsharded gradients -> the reduce-scatter input, flags included

Each op has two overloads, as aten's ops do: the functional one a graph traces (with the autograd
formulas of [Note: Traced unshard] in traced/unshard.py), and `.out`, which writes into buffers its
caller owns. The eager runtime calls `.out`: its all-gather runs in place in the output's slot, its
unsharded parameters keep their storage across steps (autograd saved them), and a custom comm may
own the buffers. The functional overload allocates and calls `.out`, so the copy code exists once,
and a profile of either path shows `fsdp_graph::copy_in`, `copy_out` and `pack_grads`.

A row of a group's all-gather holds, in this order: the trainable parameters' padded shards in
group order, one column per trainable parameter (the gradient flags, [Note: Gradient flags in a
graph]: zeros on the wire, and the reduce-scatter sums their gradient; an even number of columns,
[Note: An even number of flag columns]), then the frozen parameters' padded shards. A group with no
trainable parameter has no flags. The reduce-scatter row holds the trainable parameters' gradients
in group order, then the flags ([Note: Every rank packs every parameter] in runtime/collectives.py).
A byte bucket ([Note: Byte buckets]) gathers in group order without flags and reduces as any other
group.

Where the traced path needs no copy it calls no op: a row of a single piece is that piece (padded
with `F.pad` where it is narrower than its block), and a group of one frozen parameter is a view
of its gathered rows ([Note: Traced unshard]). A traced group with frozen parameters copies its
row in as two parts, the blocks the backward reduces and the frozen ones, which `AllGatherShards`
(traced/unshard.py) joins, so that its backward hands back only the reduced columns; the bytes
are the layout's.

The shard an int `reshard_after_forward` keeps for the backward's re-gather within a smaller group
(runtime/param_group.py, `post_forward_reshard`) is rows of the gathered bucket in the same layout,
each rebuilt with `copy_in` from the gathered parameters. Only eager ranks gather it: a traced step
re-gathers from the whole shard group instead, and so does a group that fell back to the eager
hooks ([Note: Fallback groups keep the traced order] in traced/hooks.py).

The layout depends on each parameter's requires_grad, unsharded dtype and all-gather extensions,
which may change between steps ([Note: Parameters changed after fully_shard] in runtime/param.py):
`built_from` records them, and the group rebuilds its layout when they differ.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .param import ShardedParam

FLAGS = -1  # in `BucketLayout.blocks`: the gradient flags' block


def flag_columns(num_trainable: int) -> int:
    """The flags' block's width for `num_trainable` flags: [Note: An even number of flag columns]."""
    return num_trainable + num_trainable % 2


# [Note: An even number of flag columns]
# The flags' block is one column per trainable parameter, plus one zero column where that count is
# odd. Gloo's reduce-scatter over more than 2 ranks adds the ranks' rows in an order that depends
# on where an element lies in the row: appending an odd number of columns to every row changes the
# sums of a few of the elements before them by an ulp, an even number changes none (torch alone:
# the project's examples/repro/gloo_reduce_scatter_chunk_size.py; docs/benchmarks.md has the
# counts). A row of FSDP2's is a row of ours without the flags, so an even flags' block keeps the
# sums FSDP2's bit for bit on gloo. With an odd one, an ulp in one weight's gradient became, through
# AdamW, differences across every layer of torchtitan's MoE models on 4 ranks
# (tests/test_frameworks.py). The column costs one element per rank and group.


# [Note: Byte buckets]
# A group whose parameters are gathered in more than one dtype (a frozen float8 weight beside fp32
# ones, no `param_dtype`), or that has a parameter with all-gather extensions, gathers one uint8
# bucket: each parameter's piece is its padded shard in its own unsharded dtype (`param_dtype`, else
# its dtype), or its pre-hook's inputs, viewed as bytes, in group order. Casting every shard to one
# dtype instead would round fp32 weights to float8 where the float8 one comes first. FSDP2 gathers
# such groups as bytes too. A pre-hook's inputs are as wide as it makes them, so a byte bucket's
# widths are known once the pre-hooks ran: `byte_pieces` returns them with the pieces.


@dataclass(frozen=True)
class BucketLayout:
    """Where each parameter of a group lies in the group's all-gather and reduce-scatter rows.

    See [Note: One bucket layout for eager and traced steps].

    Attributes:
        world: ranks on the shard axis; rank r's row holds slot r of every block.
        blocks: the all-gather row's blocks in order, each an index into the group's parameters or
            FLAGS.
        widths: per block, its elements per rank: a parameter's padded shard, `flag_columns` for
            the flags. Empty for a byte bucket, whose pieces are as wide as the pre-hooks make them
            (`byte_pieces`).
        numels: per block, the unsharded tensor's elements (0 for the flags); empty for a byte bucket.
        reduced: the trainable parameters (indices) in group order: the reduce-scatter row's blocks,
            followed by the flags.
        reduce_widths: per reduce-scatter block, its elements per rank, the flags' last.
        reduce_numels: per reduce-scatter block, the unsharded gradient's elements (0 for the flags).
        reduce_offsets: where each reduce-scatter block starts in a rank's reduced row, then the
            row's end.
        flags_at: the flags' block in the all-gather row, -1 without one.
        dtype: the all-gather row's dtype: the parameters' unsharded dtype, uint8 for a byte bucket.
        as_bytes: whether the group gathers one byte bucket ([Note: Byte buckets]).
        built_from: per parameter, (requires_grad, unsharded dtype, has all-gather extensions).
        shard_dims: per parameter, the dim it is sharded on.
        moved_sizes: for a plain bucket, per parameter, its rank and then its size with the shard
            dim first, end to end: how a traced step views `copy_out`'s flat outputs as the
            unsharded parameters (`fsdp_graph::gather_group` takes flat ints).
    """

    world: int
    blocks: tuple[int, ...]
    widths: tuple[int, ...]
    numels: tuple[int, ...]
    reduced: tuple[int, ...]
    reduce_widths: tuple[int, ...]
    reduce_numels: tuple[int, ...]
    reduce_offsets: tuple[int, ...]
    flags_at: int
    dtype: torch.dtype
    as_bytes: bool
    built_from: tuple[tuple[bool, torch.dtype, bool], ...]
    shard_dims: tuple[int, ...]
    moved_sizes: tuple[int, ...]

    @staticmethod
    def inputs_of(params: list[ShardedParam]) -> tuple[tuple[bool, torch.dtype, bool], ...]:
        """What a layout of `params` depends on, read now (`built_from`)."""
        return tuple((p.requires_grad, p.unsharded_dtype, p.has_gather_hooks()) for p in params)

    @classmethod
    def build(cls, params: list[ShardedParam], world: int) -> BucketLayout:
        built_from = cls.inputs_of(params)
        reduced = tuple(i for i, (requires_grad, _, _) in enumerate(built_from) if requires_grad)
        dtypes = {dtype for _, dtype, _ in built_from}
        as_bytes = len(dtypes) > 1 or any(hooks for _, _, hooks in built_from)
        if as_bytes:
            blocks, widths, numels, dtype = tuple(range(len(params))), (), (), torch.uint8
        else:
            frozen = tuple(i for i in range(len(params)) if i not in reduced)
            blocks = reduced + ((FLAGS,) if reduced else ()) + frozen
            widths = tuple(flag_columns(len(reduced)) if i == FLAGS else params[i].shard_numel for i in blocks)
            numels = tuple(0 if i == FLAGS else params[i].local_size.numel() for i in blocks)
            (dtype,) = dtypes
        reduce_widths = tuple(params[i].shard_numel for i in reduced) + (flag_columns(len(reduced)),)
        return cls(
            world=world,
            blocks=blocks,
            widths=widths,
            numels=numels,
            reduced=reduced,
            reduce_widths=reduce_widths,
            reduce_numels=tuple(params[i].local_size.numel() for i in reduced) + (0,),
            reduce_offsets=tuple(itertools.accumulate(reduce_widths, initial=0)),
            flags_at=blocks.index(FLAGS) if FLAGS in blocks else -1,
            dtype=dtype,
            as_bytes=as_bytes,
            built_from=built_from,
            shard_dims=tuple(p.shard_dim for p in params),
            moved_sizes=() if as_bytes else tuple(n for p in params for n in (len(p.moved_size), *p.moved_size)),
        )

    @property
    def num_trainable(self) -> int:
        return len(self.reduced)

    def has_hooks(self, index: int) -> bool:
        """Whether parameter `index` brings all-gather extensions (then the bucket is bytes)."""
        return self.built_from[index][2]

    def shard_pieces(self, params: list[ShardedParam], flags: torch.Tensor) -> list[torch.Tensor]:
        """Per block of a plain bucket, what `copy_in` pads into this rank's row: the flat shards,
        and `flags` for the flags' block (an empty tensor is padded to zeros)."""
        return [flags if i == FLAGS else params[i].flat_local_shard() for i in self.blocks]

    def byte_pieces(
        self, params: list[ShardedParam], pre_all_gather: Callable[[int], list[torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """This rank's pieces of a byte bucket and their widths in bytes, in group order: the inputs
        `pre_all_gather(i)` returns for parameter i if it has all-gather extensions, else its shard
        in its unsharded dtype (which `copy_in` pads to the padded shard's bytes)."""
        pieces, widths = [], []
        for i in self.blocks:
            p = params[i]
            if self.has_hooks(i):
                for t in pre_all_gather(i):
                    pieces.append(t.contiguous().view(-1).view(torch.uint8))
                    widths.append(pieces[-1].numel())
            else:
                shard = p.flat_local_shard().to(p.unsharded_dtype)
                pieces.append(shard.view(torch.uint8))
                widths.append(p.shard_numel * shard.element_size())
        return pieces, widths


# -- the registered ops: see [Note: One bucket layout for eager and traced steps] -------------------


# The `.out` overloads are what the eager runtime calls at every gather and reduction, so they are
# defined with torch.library's low-level API: one Python kernel per call, without the autograd and
# version-counter wrappers `custom_op` puts around an op that mutates (the eager runtime calls them
# under no_grad and keeps the version counters of the storage it refills itself).
_OUT_OVERLOADS = torch.library.Library("fsdp_graph", "FRAGMENT")
_OUT_OVERLOADS.define("copy_in.out(Tensor[] shards, SymInt[] shard_numels, *, Tensor(a!) out) -> ()")
_OUT_OVERLOADS.define(
    "copy_out.out(Tensor gathered, SymInt world, SymInt[] shard_numels, *, Tensor(a!)[] out) -> ()"
)
_OUT_OVERLOADS.define(
    "pack_grads.out(Tensor?[] grads, SymInt world, SymInt[] shard_numels, SymInt[] numels, SymInt flags_at, *, "
    "Tensor(a!) out) -> ()"
)


@torch.library.custom_op("fsdp_graph::copy_in", mutates_args=())
def copy_in(shards: list[torch.Tensor], shard_numels: list[int]) -> torch.Tensor:
    """This rank's row of the bucket: each flat shard, zero-padded to `shard_numels[i]`, in order."""
    row = shards[0].new_empty(sum(shard_numels))
    torch.ops.fsdp_graph.copy_in.out(shards, shard_numels, out=row)
    return row


@torch.library.impl(_OUT_OVERLOADS, "copy_in.out", "CompositeExplicitAutograd")
def _copy_in_out(shards: list[torch.Tensor], shard_numels: list[int], *, out: torch.Tensor) -> None:
    """`copy_in` into `out` (of `sum(shard_numels)` elements), casting to its dtype and device.

    One `cat` writes the whole row, each piece's padding included (a zero broadcast to the
    padding's length), so a row costs one kernel however many parameters it holds. Pieces on
    another device than `out` (CPU-offloaded shards) are copied one by one instead."""
    if any(shard.device != out.device for shard in shards):
        offset = 0
        for shard, shard_numel in zip(shards, shard_numels):
            out[offset : offset + shard.numel()].copy_(shard)
            out[offset + shard.numel() : offset + shard_numel].zero_()
            offset += shard_numel
        return
    zero = out.new_zeros(())
    pieces = []
    for shard, shard_numel in zip(shards, shard_numels):
        pieces.append(shard.reshape(-1))
        if shard.numel() < shard_numel:
            pieces.append(zero.expand(shard_numel - shard.numel()))
    torch.cat(pieces, out=out)


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
    full = [gathered.new_empty(world * shard_numel) for shard_numel in shard_numels]
    rows = [t.view(world, shard_numel) for t, shard_numel in zip(full, shard_numels)]
    torch.ops.fsdp_graph.copy_out.out(gathered, world, shard_numels, out=rows)
    return [t[:numel] for t, numel in zip(full, numels)]


@torch.library.impl(_OUT_OVERLOADS, "copy_out.out", "CompositeExplicitAutograd")
def _copy_out_out(gathered: torch.Tensor, world: int, shard_numels: list[int], *, out: list[torch.Tensor]) -> None:
    """`copy_out` into `out`: block i's columns of every row into `out[i]`, (world, shard_numels[i])."""
    torch.split_with_sizes_copy(gathered.view(world, -1), shard_numels, dim=1, out=out)


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
    [Note: Gradient flags in a graph]), zero-padded to its width."""
    packed = torch.empty(world * sum(shard_numels), dtype=dtype, device=device)
    torch.ops.fsdp_graph.pack_grads.out(grads, world, shard_numels, numels, flags_at, out=packed)
    return packed


@torch.library.impl(_OUT_OVERLOADS, "pack_grads.out", "CompositeExplicitAutograd")
def _pack_grads_out(
    grads: list[Optional[torch.Tensor]],
    world: int,
    shard_numels: list[int],
    numels: list[int],
    flags_at: int,
    *,
    out: torch.Tensor,
) -> None:
    """`pack_grads` into `out` (world * sum(shard_numels) elements), casting to its dtype. A
    gradient is flat or in the layout the collectives move (a shard dim k > 0 moved first).

    Block i of `out.view(world, -1)` is (world, shard_numels[i]): a gradient of exactly that many
    elements is that block row by row, so one `cat` along the columns writes every such block, the
    flags and the zeros of a missing gradient (a zero broadcast to the block). A padded gradient
    (fewer rows than world slots) gets zeros there first and its rows after, row by row."""
    packed = out.view(world, -1)
    zero = out.new_zeros(())
    blocks, padded = [], []
    for i, (grad, shard_numel, numel) in enumerate(zip(grads, shard_numels, numels)):
        if i == flags_at:
            flags = _grad_flags(grads[:i], out)
            blocks.append(F.pad(flags, (0, shard_numel - flags.numel())).expand(world, -1))
        elif grad is None or numel == 0:
            blocks.append(zero.expand(world, shard_numel))
        elif numel == world * shard_numel:
            blocks.append(grad.reshape(world, shard_numel))
        else:
            blocks.append(zero.expand(world, shard_numel))
            padded.append((sum(shard_numels[:i]), grad, shard_numel, numel))
    torch.cat(blocks, dim=1, out=packed)
    for offset, grad, shard_numel, numel in padded:
        block = packed[:, offset : offset + shard_numel]
        flat = grad.reshape(-1)
        full_rows, rest = divmod(numel, shard_numel)
        if full_rows:
            block[:full_rows].copy_(flat[: full_rows * shard_numel].view(full_rows, shard_numel))
        if rest:
            block[full_rows, :rest].copy_(flat[full_rows * shard_numel :])


def _grad_flags(grads: list[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """1 where a gradient is given, else 0, made on `like`'s device: a list built on the host and
    copied over would make the host wait for the device (a pageable copy) in every backward."""
    if all(grad is not None for grad in grads):
        return like.new_ones(len(grads))
    return torch.cat([like.new_ones(1) if grad is not None else like.new_zeros(1) for grad in grads])


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
