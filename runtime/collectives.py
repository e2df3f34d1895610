"""The eager runtime's two bucketed collectives: all-gather of a group's shards, reduce-scatter of its
gradients, on side streams (CUDA) or as async work handles (CPU/gloo).

[Note: Streams without record_stream]
On CUDA each collective has its own stream so it overlaps compute on the current stream:

    copy-in stream:        cast/copy shards into the flat all-gather input
    all-gather stream:     all_gather_single(input -> output)
    current stream:        copy-out into unsharded parameters, forward/backward compute
    reduce-scatter stream: pack gradients, reduce_scatter_single (+ all_reduce for HSDP), divide

A tensor used on a stream other than the one it was allocated on could be recycled by the caching
allocator while still in use. Instead of `record_stream` (which frees at an unknown later point) we
keep such tensors referenced until the allocating stream has waited for an event recorded after
their last use; each buffer below says when that is. Memory is therefore freed at known points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .bucket_layout import FLAGS, BucketLayout
from .custom_comms import AllGather, Comm, ReduceScatter
from .mesh_info import MeshInfo
from .param import ShardedParam
from .shard_buffer import ShardBuffer

# (packed gradient, output shard, shard process group) -> None: writes the summed shard to output.
CommHook = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]


class CommContext:
    """Streams and retired buffers shared by every group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type == "cuda"
        if self.uses_streams:
            self._device_module = torch.get_device_module(device.type)
            # Copies shards into all-gather inputs; waits for the current stream so it reads shards
            # after the optimizer step. Lives as long as the root.
            self.copy_in_stream = self._device_module.Stream(device=device, priority=-1)
            # Runs all-gathers; high priority so prefetches are not queued behind compute.
            self.all_gather_stream = self._device_module.Stream(device=device, priority=-1)
            # Packs, reduce-scatters and divides gradients.
            self.reduce_scatter_stream = self._device_module.Stream(device=device, priority=-1)
        # All-gather buffers whose copy-out was issued, each with the current-stream event after that
        # copy-out. They die at the next all-gather, once the copy-in stream has waited the events.
        self._retired_all_gathers: list[tuple[AllGatherWork, object]] = []
        # Issued reduce-scatters whose sharded gradients are not written yet, oldest first.
        self.pending_reduce_scatters: list[ReduceScatterWork] = []
        # `set_post_optim_event`: what the next copy-in waits for instead of the whole current stream.
        self.post_optim_event: Optional[torch.Event] = None

    def current_stream(self):
        return self._device_module.current_stream(self.device)

    def retire(self, work: "AllGatherWork") -> None:
        if self.uses_streams:
            event = self.current_stream().record_event()
            self._retired_all_gathers.append((work, event))

    def add_reduce_scatter(self, work: "ReduceScatterWork") -> None:
        """Track an issued reduce-scatter until `finish_reduce_scatters`."""
        self.pending_reduce_scatters.append(work)

    def finish_reduce_scatters(self, but_waiting: bool = False) -> None:
        """Finish the issued reduce-scatters; with `but_waiting`, not those whose replica all-reduce
        waits for its turn in a replayed plan (`ReduceScatterWork.all_reduce_later`)."""
        works, self.pending_reduce_scatters = self.pending_reduce_scatters, []
        for work in works:
            if but_waiting and work.all_reduce_later:
                self.pending_reduce_scatters.append(work)
            else:
                work.finish(self)

    def discard_reduce_scatters(self) -> None:
        """Wait for the issued reduce-scatters to end and drop their gradients (`reset_iter_state`)."""
        for work in self.pending_reduce_scatters:
            if work.handle is not None:
                work.handle.wait()
            if work.event is not None:
                self.current_stream().wait_event(work.event)
        self.pending_reduce_scatters.clear()

    def copy_in_waits_for_optimizer(self) -> None:
        """Order the next copy-in after the optimizer step: after the user's post-optimizer event
        if one was set (once), else after everything on the current stream."""
        if self.post_optim_event is not None:
            self.copy_in_stream.wait_event(self.post_optim_event)
            self.post_optim_event = None
        else:
            self.copy_in_stream.wait_stream(self.current_stream())

    def release_retired(self) -> None:
        for _, event in self._retired_all_gathers:
            self.copy_in_stream.wait_event(event)
        self._retired_all_gathers.clear()


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
# traced steps do the same in the graph (runtime/traced.py), which then holds no collective.


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
        if comm_ctx.uses_streams:
            comm_ctx.release_retired()  # else the retired buffers would pile up: no stream waits here
        _, row, widths = output_and_row()
        return AllGatherWork(row, row, widths, layout, done=True)
    if not comm_ctx.uses_streams:
        output, row, widths = output_and_row()
        if comm is not None:
            handle = comm(output, row, group, async_op=async_op)
        else:
            handle = dist.all_gather_single(output, row, group=group, async_op=async_op)
        return AllGatherWork(output, row, widths, layout, handle=handle, done=not async_op)

    mod = comm_ctx._device_module
    output, row, widths = _on_copy_in_stream(comm_ctx, output_and_row)
    comm_ctx.all_gather_stream.wait_stream(comm_ctx.copy_in_stream)
    with mod.stream(comm_ctx.all_gather_stream):
        if comm is not None:
            comm(output, row, group)
        else:
            dist.all_gather_single(output, row, group=group)
        event = comm_ctx.all_gather_stream.record_event()
    work = AllGatherWork(output, row, widths, layout, event=event)
    if not async_op:
        work.wait(comm_ctx)
    return work


def _on_copy_in_stream(comm_ctx: CommContext, copy_in: Callable[[], tuple]) -> tuple:
    """Run `copy_in` on the copy-in stream (CUDA), after the retired all-gather buffers are free and
    the optimizer step is done with the shards."""
    comm_ctx.release_retired()
    comm_ctx.copy_in_waits_for_optimizer()
    with comm_ctx._device_module.stream(comm_ctx.copy_in_stream):
        return copy_in()


def copy_out(params: list[ShardedParam], work: AllGatherWork, world: int) -> None:
    """Split the all-gather output into each parameter's unsharded storage with
    `fsdp_graph::copy_out`; a byte bucket's post-hooks then rebuild their parameters."""
    layout = work.layout
    outputs = []
    for i in layout.blocks:
        if i == FLAGS:  # the flags' columns carry nothing for the eager runtime
            outputs.append(work.output.new_empty(world, layout.num_trainable))
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
    output: torch.Tensor  # this rank's reduced, divided shard of every param, flat, then one flag per param
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
            got_grad = [flag > 0 for flag in flags.tolist()]
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
# The flags cost one element per parameter and no collective of their own.
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

    if not comm_ctx.uses_streams:
        packed = _pack(layout, params, grads, dtype, comm_ctx.device, buffers)
        if pre != 1:
            packed.div_(pre)
        if not issue:
            work.handle, work.keep_alive = PieceHandles(), [packed]
            return work
        if comm_hook is not None:
            comm_hook(packed, output, shard_group)
            work.reduce_across_replicas_and_divide()
            return work
        if world == 1:  # [Note: One rank issues no collectives]
            output.copy_(packed)
            if not all_reduce_later:
                work.reduce_across_replicas_and_divide()
            return work
        if comm is not None:
            work.handle = comm(output, packed, shard_group, dist.ReduceOp.SUM, async_op=True)
        else:
            work.handle = dist.reduce_scatter_single(
                output, packed, op=dist.ReduceOp.SUM, group=shard_group, async_op=True
            )
        if work.handle is None and not all_reduce_later:  # a custom comm that ran synchronously
            work.reduce_across_replicas_and_divide()
        work.keep_alive = [packed]
        return work

    mod = comm_ctx._device_module
    comm_ctx.reduce_scatter_stream.wait_stream(comm_ctx.current_stream())
    with mod.stream(comm_ctx.reduce_scatter_stream):
        packed = _pack(layout, params, grads, dtype, comm_ctx.device, buffers)
        if pre != 1:
            packed.div_(pre)
        if not issue:
            work.keep_alive = [packed, grads]
            return work
        if comm_hook is not None:
            comm_hook(packed, output, shard_group)
        elif world == 1:  # [Note: One rank issues no collectives]
            output.copy_(packed)
        elif comm is not None:
            comm(output, packed, shard_group, dist.ReduceOp.SUM)
        else:
            dist.reduce_scatter_single(output, packed, op=dist.ReduceOp.SUM, group=shard_group)
        if not all_reduce_later:
            work.reduce_across_replicas_and_divide(comm_ctx)
            work.event = comm_ctx.reduce_scatter_stream.record_event()
    work.keep_alive = [packed, grads]
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

    if not comm_ctx.uses_streams:
        return AllGatherWork(*copy_in(), layout, handle=PieceHandles())
    return AllGatherWork(*_on_copy_in_stream(comm_ctx, copy_in), layout)


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


@torch.no_grad()
def all_gather_pieces(pieces: list[tuple[AllGatherWork, int, int]], group: dist.ProcessGroup, world: int, comm_ctx: CommContext) -> None:
    """One all-gather of columns [lo, hi) of each prepared bucket's row, side by side ([Note: A compiled
    graph's buckets on the eager hooks]); each bucket gets its columns of every rank back."""
    starts = _offsets(pieces)

    def issue(async_op: bool) -> tuple[Optional[dist.Work], torch.Tensor, torch.Tensor]:
        row = torch.cat([work.input[lo:hi] for work, lo, hi in pieces])
        gathered = row.new_empty(world * row.numel())
        return dist.all_gather_single(gathered, row, group=group, async_op=async_op), row, gathered

    def copy_back(gathered: torch.Tensor, i: int) -> None:
        work, lo, hi = pieces[i]
        _copy_columns(gathered, world, starts[i], work.output, lo, hi, into_tensor=True)

    if not comm_ctx.uses_streams:
        handle, row, gathered = issue(async_op=True)
        for i, (work, _, _) in enumerate(pieces):
            work.handle.add(handle, lambda i=i: copy_back(gathered, i), row)
        return
    comm_ctx.all_gather_stream.wait_stream(comm_ctx.copy_in_stream)
    with comm_ctx._device_module.stream(comm_ctx.all_gather_stream):
        _, _, gathered = issue(async_op=False)
        for i in range(len(pieces)):
            copy_back(gathered, i)
        event = comm_ctx.all_gather_stream.record_event()
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

    def issue(async_op: bool) -> tuple[Optional[dist.Work], torch.Tensor, torch.Tensor]:
        width = sum(hi - lo for _, lo, hi in pieces)
        packed = pieces[0][0].keep_alive[0].new_empty(world * width)
        for (work, lo, hi), start in zip(pieces, starts):
            _copy_columns(packed, world, start, work.keep_alive[0], lo, hi, into_tensor=False)
        summed = packed.new_empty(width)
        handle = dist.reduce_scatter_single(summed, packed, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return handle, packed, summed

    def copy_back(summed: torch.Tensor, i: int) -> None:
        work, lo, hi = pieces[i]
        _copy_columns(summed, 1, starts[i], work.output, lo, hi, into_tensor=True)

    if not comm_ctx.uses_streams:
        handle, packed, summed = issue(async_op=True)
        for i, (work, _, _) in enumerate(pieces):
            work.handle.add(handle, lambda i=i: copy_back(summed, i), packed)
        return
    with comm_ctx._device_module.stream(comm_ctx.reduce_scatter_stream):
        _, _, summed = issue(async_op=False)
        for i in range(len(pieces)):
            copy_back(summed, i)


def reduce_scatter_issued(work: ReduceScatterWork, comm_ctx: CommContext) -> None:
    """Every column of `work`'s bucket is issued: on CUDA queue what `finish` waits for (the replica
    all-reduce and the division, unless `all_reduce_later`); on CPU `finish` does it after the wait."""
    if comm_ctx.uses_streams and not work.all_reduce_later:
        with comm_ctx._device_module.stream(comm_ctx.reduce_scatter_stream):
            work.reduce_across_replicas_and_divide(comm_ctx)
            work.event = comm_ctx.reduce_scatter_stream.record_event()
