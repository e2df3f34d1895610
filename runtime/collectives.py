"""The eager runtime's two bucketed collectives: all-gather of a group's shards, reduce-scatter of its
gradients, on side streams (CUDA) or as async work handles (CPU/gloo), as `CommContext`
(runtime/comm_context.py) places them: [Note: Streams without record_stream] and [Note: One
sequence, on a stream or inline] there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .bucket_layout import FLAGS, BucketLayout
from .comm_context import CommContext
from .custom_comms import AllGather, Comm, ReduceScatter
from .mesh_info import MeshInfo
from .param import ShardedParam
from .shard_buffer import ShardBuffer

# (packed gradient, output shard, shard process group) -> None: writes the summed shard to output.
CommHook = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]


@dataclass
class AllGatherWork:
    """An issued all-gather: its output (world rows of the bucket) and how to wait for it."""

    output: torch.Tensor
    # A view of `output`, the group's shard buffer, or a post-forward shard; kept until the gather ends.
    input: torch.Tensor
    widths: list[int]  # each block's elements per rank, as `copy_out` splits the rows
    layout: BucketLayout  # the layout the row was built in
    handle: Optional[dist.Work] = None  # CPU: the async work handle
    event: object = None  # CUDA: recorded on the all-gather stream after the collective
    done: bool = False

    @torch.no_grad()
    def wait(self, comm_ctx: CommContext) -> None:
        if self.done:
            return
        if self.handle is not None:
            self.handle.wait()
        if self.event is not None:
            comm_ctx.current_stream().wait_event(self.event)
        self.done = True


def _allocate(comm: Optional[Comm], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return comm.allocate((numel,), dtype=dtype, device=device)


def _copy_in(
    layout: BucketLayout,
    params: list[ShardedParam],
    world: int,
    rank: int,
    buffers: Optional[Comm],
    device: torch.device,
    shard_buffer: Optional[ShardBuffer] = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Allocate the all-gather output and this rank's row of it; return the output, the row (the
    all-gather's input) and the blocks' widths.

    With a shard buffer ([Note: Sharded parameters live in their group's row] in
    runtime/shard_buffer.py) the row is the buffer itself: nothing is copied, and the all-gather
    reads it in place into its own output. It is copied (one `fsdp_graph::copy_in` of the whole
    row) only where it must change: cast to `param_dtype`, moved to the device (CPU offload), or
    into a custom comm's or the process group's buffer. Without one, the shards are copied (and
    cast) into the output's slot with `fsdp_graph::copy_in`, and the all-gather runs in place (its
    input is a view of its output), so a bucket in flight costs one buffer, not two.
    """
    if shard_buffer is not None and shard_buffer.layout is layout:
        shard_buffer.copy_in_others(params)
        flat = shard_buffer.flat
        total = flat.numel()
        # `device` names an accelerator with its index (`_mesh_device`), as the buffer's device does.
        in_place = buffers is None and flat.dtype == layout.dtype and flat.device == device
        if in_place and world == 1:  # the bucket is the row: [Note: One rank issues no collectives]
            return flat, flat, list(layout.widths)
        output = _allocate(buffers, world * total, layout.dtype, device)
        if in_place:
            return output, flat, list(layout.widths)
        row = output[rank * total : (rank + 1) * total]
        torch.ops.fsdp_graph.copy_in.out([flat], [total], out=row)
        return output, row, list(layout.widths)
    if layout.as_bytes:
        pieces, widths = layout.byte_pieces(params, lambda i: params[i].pre_all_gather())
    else:  # the flags' block gets an empty piece: zeros
        pieces, widths = layout.shard_pieces(params, torch.empty(0, device=device)), list(layout.widths)
    total = sum(widths)
    output = _allocate(buffers, world * total, layout.dtype, device)
    row = output[rank * total : (rank + 1) * total]
    torch.ops.fsdp_graph.copy_in.out(pieces, widths, out=row)
    return output, row, widths


# [Note: One rank issues no collectives]
# With one rank on the shard axis (world size 1, or HSDP with shards of one rank) the all-gather
# output is this rank's shard and the reduce-scatter output is its input, so, as FSDP2 does, neither
# is issued (nor a custom comm): the shard is copied into the bucket, the packed gradient is divided
# in place. With one replica the HSDP all-reduce is skipped too. The numbers are the same; the
# traced steps do the same in the graph (traced/unshard.py), which then holds no collective.


@torch.no_grad()
def all_gather(
    layout: BucketLayout,
    params: list[ShardedParam],
    group: dist.ProcessGroup,
    world: int,
    comm_ctx: CommContext,
    async_op: bool,
    input: Optional[torch.Tensor] = None,
    comm: Optional[AllGather] = None,
    allocator: Optional[Comm] = None,
    shard_buffer: Optional[ShardBuffer] = None,
) -> AllGatherWork:
    """Gather `params` (the group's) as one bucket laid out by `layout`. `input` replaces the
    copy-in (a post-forward shard, in the layout's blocks); `shard_buffer` is the row the shards
    live in, gathered as it is; `comm` replaces `all_gather_single` and its buffer
    (`set_custom_all_gather`); `allocator` only the buffer (`ProcessGroupAllocator`)."""
    device = comm_ctx.device
    buffers = comm if comm is not None else allocator
    rank = 0 if world == 1 else dist.get_rank(group)

    def output_and_row() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if input is None:
            return _copy_in(layout, params, world, rank, buffers, device, shard_buffer)
        return _allocate(buffers, world * input.numel(), input.dtype, device), input, list(layout.widths)

    if world == 1:  # [Note: One rank issues no collectives]
        comm_ctx.release_retired()  # else the retired buffers would pile up: no stream waits here
        _, row, widths = output_and_row()
        return AllGatherWork(row, row, widths, layout, done=True)
    output, row, widths = _on_copy_in_stream(comm_ctx, output_and_row)
    with comm_ctx.on(comm_ctx.all_gather_stream, after=comm_ctx.copy_in_stream):
        if comm is not None:
            handle = comm_ctx.issue(lambda a: comm(output, row, group, async_op=a), async_op)
        else:
            handle = comm_ctx.issue(lambda a: dist.all_gather_single(output, row, group=group, async_op=a), async_op)
        event = comm_ctx.record_event(comm_ctx.all_gather_stream)
    work = AllGatherWork(output, row, widths, layout, handle=handle, event=event)
    if not async_op:
        work.wait(comm_ctx)
    return work


def _on_copy_in_stream(comm_ctx: CommContext, copy_in: Callable[[], tuple]) -> tuple:
    """Run `copy_in` on the copy-in stream (CUDA), after the retired all-gather buffers are free and
    the optimizer step is done with the shards; inline without streams."""
    if not comm_ctx.uses_streams:
        return copy_in()
    comm_ctx.release_retired()
    comm_ctx.copy_in_waits_for_optimizer()
    with comm_ctx.on(comm_ctx.copy_in_stream):
        return copy_in()


def copy_out(params: list[ShardedParam], work: AllGatherWork, world: int) -> None:
    """Split the all-gather output into each parameter's unsharded storage with
    `fsdp_graph::copy_out`; a byte bucket's post-hooks then rebuild their parameters."""
    layout = work.layout
    outputs = []
    for i in layout.blocks:
        if i == FLAGS:  # the flags' columns carry nothing for the eager runtime
            outputs.append(work.output.new_empty(world, layout.widths[layout.flags_at]))
        elif layout.has_hooks(i):
            outputs += params[i].alloc_gather_outputs(world)
        elif layout.as_bytes:
            outputs.append(params[i].alloc_unsharded(world).view(torch.uint8))
        else:
            outputs.append(params[i].alloc_unsharded(world))
    # Refilling storage autograd saved is not a modification it should see: the values are the
    # ones forward used. Keep the version counters so saved-tensor checks still pass.
    unsharded = tuple(t for p in params if p.unsharded_param is not None for t in p.unsharded_tensors())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(unsharded):
        torch.ops.fsdp_graph.copy_out.out(work.output, world, work.widths, out=outputs)
        for i, p in enumerate(params):
            if layout.has_hooks(i):
                p.post_all_gather()
            else:
                p.finish_copy_out()


def divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post): divide the gradients by `pre` before the sum and the sum by `post`, as FSDP2 does.

    [Note: fp16 divides before and after the sum]

    fp16 has little range: summing N full-size gradients can overflow, and dividing by N first can
    underflow. So every dtype but fp32 and bf16 (FSDP2's rule) splits the division around the sum:
    `pre` doubles while it divides `factor` and stays below `factor / pre` (about sqrt(N)).
    """
    if dtype in (torch.float32, torch.bfloat16):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


@dataclass
class ReduceControls:
    """A group's user controls of its gradient reduction (FSDP2's setters); see `ReduceScatterWork`."""

    all_reduce: bool = True  # HSDP: False reduce-scatters but skips the replica all-reduce
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None  # runs on the reduced output
    all_reduce_hook_stream: object = None  # CUDA: the stream the hook runs on; see `run_all_reduce_hook`
    force_sum: bool = False  # how FSDP2's collectives reduce; ours always sum, see the hook order
    partial: Optional[torch.Tensor] = None  # HSDP: reduce-scattered sums waiting for the all-reduce
    # `set_separate_reduce_scatter_group`: reduce-scatter on a process group of its own, so it can
    # progress alongside all-gathers on the shard group (one communicator runs one at a time).
    reduce_scatter_group: Optional[dist.ProcessGroup] = None
    # `set_reduce_scatter_unused_params(True)`: a trainable parameter no rank had a gradient for gets
    # zeros (the reduced value), as in FSDP2, instead of keeping `.grad` None. See
    # [Note: Every rank packs every parameter].
    zeros_for_unused: bool = False


@dataclass
class ReduceScatterWork:
    """An issued gradient reduce-scatter for one group; `finish` writes the sharded gradients.

    See [Note: Every rank packs every parameter] for the flags at the end of `output`.
    """

    params: list[ShardedParam]  # the trainable parameters, in the order they were packed
    output: torch.Tensor  # this rank's reduced, divided shard of every param, flat, then the flags' columns
    mesh_info: MeshInfo
    divide_factor: float  # the post-divide factor: see `divide_factors`
    had_grad: list[bool]  # per param: did this rank pack a gradient
    controls: "ReduceControls" = None
    widths: tuple[int, ...] = ()  # the blocks of `output`: `BucketLayout.reduce_widths`
    handle: Optional[dist.Work] = None  # CPU: the async work handle
    event: object = None  # CUDA: recorded on the reduce-scatter stream after the division
    # CUDA: the packed input and the unsharded gradients, read on the reduce-scatter stream but
    # allocated on the current one; they die in `finish`, after the current stream waited `event`.
    keep_alive: list = field(default_factory=list)
    # HSDP on a rank that replays a compiled graph's collectives: the replica all-reduce waits for
    # its turn in the graph's order, `issue_replica_all_reduce` ([Note: A fallback keeps the frame's
    # wire order] in runtime/wire_plan.py).
    all_reduce_later: bool = False
    all_reduced: bool = False  # CPU: `handle` is the replica all-reduce's, issued in its turn

    def reduce_across_replicas_and_divide(self, comm_ctx: Optional[CommContext] = None) -> None:
        """The replica all-reduce, the all-reduce hook and the division; `comm_ctx` when this runs on the
        reduce-scatter stream (CUDA), for the hook's own stream."""
        self._all_reduce_across_replicas(async_op=False)
        self._divide(comm_ctx)

    def _all_reduce_across_replicas(self, async_op: bool) -> Optional[dist.Work]:
        """Add what earlier reduce-scatters kept, then HSDP's all-reduce of the sum over the replicas."""
        controls = self.controls
        if controls.partial is not None:  # reduce-scattered earlier without the replica all-reduce
            self.output.add_(controls.partial)
            controls.partial = None
        if self.mesh_info.is_hsdp and controls.all_reduce and self.mesh_info.replicate_size > 1:
            # [Note: One rank issues no collectives]
            return dist.all_reduce(self.output, group=self.mesh_info.replicate_group, async_op=async_op)
        return None

    def issue_replica_all_reduce(self, comm_ctx: CommContext) -> None:
        """The replica all-reduce of `all_reduce_later`, now: once the reduce-scatter ended (CPU, then
        `finish` waits for the all-reduce and divides), or queued after it with the division (CUDA)."""
        self.all_reduce_later = False
        if comm_ctx.uses_streams:
            reduce_scatter_issued(self, comm_ctx)
            return
        if self.handle is not None:
            self.handle.wait()
        self.handle = self._all_reduce_across_replicas(async_op=True)
        self.all_reduced = True
        if self.handle is None:
            self._divide()

    def _divide(self, comm_ctx: Optional[CommContext] = None) -> None:
        """The all-reduce hook and the division, after the reduction over the replicas."""
        controls = self.controls
        if self.mesh_info.is_hsdp and not controls.all_reduce:
            return  # `finish` keeps the sum as the next reduction's partial
        hook = controls.all_reduce_hook
        grads = self.output[: self.output.numel() - len(self.params)]
        # FSDP2 hands the hook an already averaged output when its collectives average (fp32/bf16
        # without forced sums), and the sum before the post-divide otherwise.
        divide_first = not controls.force_sum and self.output.dtype in (torch.float32, torch.bfloat16)
        if hook is not None and not divide_first:
            self.run_all_reduce_hook(grads, comm_ctx)
        self.output.div_(self.divide_factor)
        if hook is not None and divide_first:
            self.run_all_reduce_hook(grads, comm_ctx)

    def run_all_reduce_hook(self, grads: torch.Tensor, comm_ctx: Optional[CommContext]) -> None:
        """Run the all-reduce hook on `grads`.

        [Note: The all-reduce hook's stream]
        `set_all_reduce_hook(hook, stream=s)` runs the hook on `s`, as FSDP2 does: `s` first waits for
        the reduce-scatter stream (the reduced gradients), the hook's kernels go to `s`, and the
        reduce-scatter stream then waits for `s` before it divides and records the event the current
        stream waits for, so the optimizer reads the hook's result. `grads` outlives that event
        (`finish` keeps it), so nothing is freed while `s` may still use it. Without streams (CPU)
        the hook just runs.
        """
        stream = self.controls.all_reduce_hook_stream
        if stream is None or comm_ctx is None or not comm_ctx.uses_streams:
            self.controls.all_reduce_hook(grads)
            return
        stream.wait_stream(comm_ctx.reduce_scatter_stream)
        with comm_ctx._device_module.stream(stream):
            self.controls.all_reduce_hook(grads)
        comm_ctx.reduce_scatter_stream.wait_stream(stream)

    @torch.no_grad()
    def finish(self, comm_ctx: CommContext) -> None:
        if self.all_reduce_later:  # finished before the replayed plan reached its all-reduce
            self.issue_replica_all_reduce(comm_ctx)
        if self.handle is not None:
            self.handle.wait()
            (self._divide if self.all_reduced else self.reduce_across_replicas_and_divide)()
        if self.event is not None:
            comm_ctx.current_stream().wait_event(self.event)
        if self.mesh_info.is_hsdp and not self.controls.all_reduce:
            self.controls.partial = self.output  # set_requires_all_reduce(False): no gradient yet
            self.keep_alive.clear()
            return
        *shards, flags = self.output.split(self.widths)
        got_grad = self.had_grad
        if self.controls.zeros_for_unused:
            got_grad = [True] * len(self.params)
        elif not all(got_grad):  # read the summed flags only then: on CUDA reading waits for the stream
            got_grad = [flag > 0 for flag in flags[: len(self.params)].tolist()]
        for p, flag, shard in zip(self.params, got_grad, shards):
            if flag:
                p.accumulate_sharded_grad(shard)
        self.keep_alive.clear()


# [Note: Every rank packs every parameter]
# Ranks may use different parameters of one group in a step (data-dependent branches, per-rank expert
# routing). Each rank therefore packs every trainable parameter of the group, zeros where it has no
# gradient, so slot i means the same parameter on every rank and sizes always match. After the
# gradients, every row carries one flag per parameter: 1 where this rank had a gradient. The
# reduce-scatter sums the flags into every rank's shard, so all ranks agree which parameters got a
# gradient on some rank: those get the averaged gradient (zeros from the ranks that had none, as the
# unsharded model on the global batch), the others keep `.grad` as it was (None), as in eager PyTorch.
# The flags cost one element per parameter (and a zero column to make them even: [Note: An even
# number of flag columns] in runtime/bucket_layout.py) and no collective of their own.
# With `set_reduce_scatter_unused_params(True)` FSDP2 instead gives every trainable parameter of a
# group it reduces a gradient, zeros where no rank had one, so AdamW decays and steps those too; the
# group's `zeros_for_unused` control does the same here (the reduced slot is zeros already), and the
# root's final callback gives zeros to the groups that did not run, as FSDP2 reduces them then.


def _pack(
    layout: BucketLayout, params: list[ShardedParam], grads: list[Optional[torch.Tensor]], dtype, device, comm=None
) -> torch.Tensor:
    """The reduce-scatter input, from `fsdp_graph::pack_grads`: rank r's row holds every trainable
    parameter's slot r, cast to `dtype`, then the flags of [Note: Every rank packs every parameter]."""
    world = layout.world
    packed = _allocate(comm, world * sum(layout.reduce_widths), dtype, device)
    moved = [None if grad is None else params[i].shard_dim_first(grad) for i, grad in zip(layout.reduced, grads)]
    torch.ops.fsdp_graph.pack_grads.out(
        [*moved, None], world, layout.reduce_widths, layout.reduce_numels, layout.num_trainable, out=packed
    )
    return packed


@torch.no_grad()
def reduce_scatter(
    layout: BucketLayout,
    params: list[ShardedParam],
    mesh_info: MeshInfo,
    reduce_dtype: Optional[torch.dtype],
    divide_factor: float,
    comm_ctx: CommContext,
    comm_hook: Optional[CommHook] = None,
    controls: Optional["ReduceControls"] = None,
    comm: Optional[ReduceScatter] = None,
    allocator: Optional[Comm] = None,
    issue: bool = True,
    all_reduce_later: bool = False,
) -> ReduceScatterWork:
    """Reduce-scatter the unsharded gradients of the group's trainable parameters (`layout.reduced`
    of `params`) as one bucket and average them.

    Every trainable parameter is packed, with or without a gradient on this rank: see
    [Note: Every rank packs every parameter].

    The sum is divided explicitly afterwards: gloo has no PREMUL_SUM, and one code path for every
    backend keeps eager and compiled numerics identical. A `comm_hook` replaces the
    reduce-scatter itself (it runs synchronously); HSDP's all-reduce and the division stay ours.
    A custom `comm` (`set_custom_reduce_scatter`) allocates the buffers and runs the SUM; else an
    `allocator` (`ProcessGroupAllocator`) may allocate them. With `issue` False the gradients are
    only packed, for `reduce_scatter_pieces` to issue. With `all_reduce_later` HSDP's all-reduce and
    the division wait for `ReduceScatterWork.issue_replica_all_reduce`.
    """
    buffers = comm if comm is not None else allocator
    world = mesh_info.shard_size
    trainable = [params[i] for i in layout.reduced]
    dtype = reduce_dtype or trainable[0].unsharded_dtype
    grads = [p.take_unsharded_grad() for p in trainable]
    # This rank's shard of the packed row, allocated on the current stream, which later reads it for
    # the optimizer.
    output = _allocate(buffers, sum(layout.reduce_widths), dtype, comm_ctx.device)
    pre, post = divide_factors(divide_factor, dtype)
    controls = controls or ReduceControls()
    had_grad = [grad is not None for grad in grads]
    work = ReduceScatterWork(trainable, output, mesh_info, post, had_grad, controls, layout.reduce_widths)
    work.all_reduce_later = all_reduce_later
    shard_group = controls.reduce_scatter_group or mesh_info.shard_group

    with comm_ctx.on(comm_ctx.reduce_scatter_stream, after=comm_ctx.current_stream()):
        packed = _pack(layout, params, grads, dtype, comm_ctx.device, buffers)
        if pre != 1:
            packed.div_(pre)
        # Kept until `finish`: on CUDA the packed input and the unsharded gradients, read on the
        # reduce-scatter stream but allocated on the current one; without streams the packed input
        # of a collective that may still be running (or is still to be issued, by pieces).
        keep = [packed, grads] if comm_ctx.uses_streams else [packed]
        if not issue:
            work.handle, work.keep_alive = (None if comm_ctx.uses_streams else PieceHandles()), keep
            return work
        if comm_hook is not None:
            comm_hook(packed, output, shard_group)
        elif world == 1:  # [Note: One rank issues no collectives]
            output.copy_(packed)
        elif comm is not None:
            work.handle = comm_ctx.issue(lambda a: comm(output, packed, shard_group, dist.ReduceOp.SUM, async_op=a))
        else:
            work.handle = comm_ctx.issue(
                lambda a: dist.reduce_scatter_single(output, packed, op=dist.ReduceOp.SUM, group=shard_group, async_op=a)
            )
        if work.handle is None and not all_reduce_later:  # reduced (on CUDA: queued on the stream)
            work.reduce_across_replicas_and_divide(comm_ctx)
            work.event = comm_ctx.record_event(comm_ctx.reduce_scatter_stream)
    if comm_ctx.uses_streams or (comm_hook is None and world > 1):  # else nothing reads it any more
        work.keep_alive = keep
    return work


# [Note: A compiled graph's buckets on the eager hooks]
# A rank that runs a compiled step on the eager hooks issues the graph's collectives
# (runtime/wire_plan.py), and the graph may have merged several groups' buckets into one collective
# or cut one group's bucket into pieces (passes/bucketing.py). Both are one thing seen from the
# buckets: a collective carries columns [lo, hi) of one or more groups' rank-major buckets side by
# side, rank r's row being [row_a[lo_a:hi_a] | row_b[lo_b:hi_b] | ...], the layout the graph gives
# them. Each group's bucket is filled (copy-in, gradient packing) and read (copy-out, finish) as
# `all_gather` and `reduce_scatter` do; the columns are copied into the collective's own buffer and
# back out of it. Every element is summed over the same ranks as in the graph.


class PieceHandles:
    """The collectives a bucket was issued in, each with the copy of its columns back into the
    bucket: waited as one async `dist.Work` (CPU; on CUDA the copies are queued on the stream)."""

    def __init__(self) -> None:
        self._parts: list[tuple[dist.Work, Callable[[], None], torch.Tensor]] = []

    def add(self, handle: dist.Work, copy_back: Callable[[], None], sent: torch.Tensor) -> None:
        """`sent`: the collective's input, kept until it ends."""
        self._parts.append((handle, copy_back, sent))

    def wait(self) -> bool:
        for handle, copy_back, _ in self._parts:
            handle.wait()
            copy_back()
        self._parts.clear()
        return True


@torch.no_grad()
def prepare_all_gather(
    layout: BucketLayout,
    params: list[ShardedParam],
    group: dist.ProcessGroup,
    world: int,
    comm_ctx: CommContext,
    shard_buffer: Optional[ShardBuffer] = None,
) -> AllGatherWork:
    """`all_gather`'s bucket, this rank's row copied in, nothing issued: `all_gather_pieces` issues
    it. Waited as an issued all-gather once every column of it was."""
    rank = dist.get_rank(group)

    def copy_in() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        return _copy_in(layout, params, world, rank, None, comm_ctx.device, shard_buffer)

    handle = None if comm_ctx.uses_streams else PieceHandles()  # see `_copy_back`
    return AllGatherWork(*_on_copy_in_stream(comm_ctx, copy_in), layout, handle=handle)


def _copy_columns(buffer: torch.Tensor, world: int, offset: int, tensor: torch.Tensor, lo: int, hi: int, into_tensor: bool) -> None:
    """Copy columns [offset, offset + hi - lo) of `buffer`'s rank-major rows to columns [lo, hi) of
    `tensor`'s (`into_tensor`), or the other way."""
    mine, theirs = tensor.view(world, -1)[:, lo:hi], buffer.view(world, -1)[:, offset : offset + hi - lo]
    (mine.copy_(theirs) if into_tensor else theirs.copy_(mine))


def _offsets(pieces: list[tuple[object, int, int]]) -> list[int]:
    """Where each piece's columns start in the collective's row."""
    starts, total = [], 0
    for _, lo, hi in pieces:
        starts.append(total)
        total += hi - lo
    return starts


def _copy_back(work: "AllGatherWork | ReduceScatterWork", handle: Optional[dist.Work], copy: Callable[[], None], sent: torch.Tensor) -> None:
    """Copy a collective's columns back into `work`'s bucket: once `handle` ends (CPU: `work.handle`
    is the bucket's `PieceHandles`, which keeps `sent`, the collective's input, until then), or now,
    queued after the collective on its stream (CUDA, no handle)."""
    if handle is None:
        copy()
    else:
        work.handle.add(handle, copy, sent)


@torch.no_grad()
def all_gather_pieces(pieces: list[tuple[AllGatherWork, int, int]], group: dist.ProcessGroup, world: int, comm_ctx: CommContext) -> None:
    """One all-gather of columns [lo, hi) of each prepared bucket's row, side by side ([Note: A compiled
    graph's buckets on the eager hooks]); each bucket gets its columns of every rank back."""
    starts = _offsets(pieces)
    with comm_ctx.on(comm_ctx.all_gather_stream, after=comm_ctx.copy_in_stream):
        row = torch.cat([work.input[lo:hi] for work, lo, hi in pieces])
        gathered = row.new_empty(world * row.numel())
        handle = comm_ctx.issue(lambda a: dist.all_gather_single(gathered, row, group=group, async_op=a))
        for (work, lo, hi), start in zip(pieces, starts):
            copy = functools.partial(_copy_columns, gathered, world, start, work.output, lo, hi, into_tensor=True)
            _copy_back(work, handle, copy, row)
        event = comm_ctx.record_event(comm_ctx.all_gather_stream)
    for work, _, _ in pieces:
        work.event = event


@torch.no_grad()
def reduce_scatter_pieces(
    pieces: list[tuple[ReduceScatterWork, int, int]], group: dist.ProcessGroup, world: int, comm_ctx: CommContext
) -> None:
    """One reduce-scatter (SUM) of columns [lo, hi) of each packed bucket (`reduce_scatter(...,
    issue=False)`), side by side ([Note: A compiled graph's buckets on the eager hooks]); each work's
    output gets its columns of this rank's sum. `reduce_scatter_issued` then ends a work."""
    starts = _offsets(pieces)
    with comm_ctx.on(comm_ctx.reduce_scatter_stream):
        width = sum(hi - lo for _, lo, hi in pieces)
        packed = pieces[0][0].keep_alive[0].new_empty(world * width)
        for (work, lo, hi), start in zip(pieces, starts):
            _copy_columns(packed, world, start, work.keep_alive[0], lo, hi, into_tensor=False)
        summed = packed.new_empty(width)
        op = dist.ReduceOp.SUM
        handle = comm_ctx.issue(lambda a: dist.reduce_scatter_single(summed, packed, op=op, group=group, async_op=a))
        for (work, lo, hi), start in zip(pieces, starts):
            copy = functools.partial(_copy_columns, summed, 1, start, work.output, lo, hi, into_tensor=True)
            _copy_back(work, handle, copy, packed)


def reduce_scatter_issued(work: ReduceScatterWork, comm_ctx: CommContext) -> None:
    """Every column of `work`'s bucket is issued: on CUDA queue what `finish` waits for (the replica
    all-reduce and the division, unless `all_reduce_later`); on CPU `finish` does it after the wait."""
    if comm_ctx.uses_streams and not work.all_reduce_later:
        with comm_ctx.on(comm_ctx.reduce_scatter_stream):
            work.reduce_across_replicas_and_divide(comm_ctx)
            work.event = comm_ctx.record_event(comm_ctx.reduce_scatter_stream)
