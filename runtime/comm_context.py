"""Where the eager runtime's collectives run: the side streams and retired buffers shared by every
group under one root (runtime/collectives.py issues the collectives).

[Note: Streams without record_stream]
On CUDA each collective has its own stream so it overlaps compute on the current stream:

    copy-in stream:        cast/copy shards into the flat all-gather input
    all-gather stream:     all_gather_single(input -> output)
    current stream:        copy-out into unsharded parameters, forward/backward compute
    reduce-scatter stream: pack gradients, reduce_scatter_single (+ all_reduce for HSDP), divide

A tensor used on a stream other than the one it was allocated on could be recycled by the caching
allocator while still in use. Instead of `record_stream` (which frees at an unknown later point) we
keep such tensors referenced until the allocating stream has waited for an event recorded after
their last use; each buffer in runtime/collectives.py says when that is. Memory is therefore freed
at known points.

[Note: One sequence, on a stream or inline]
Each eager collective's sequence (copy-in or packing, the collective, the division) is written
once, and runs where `CommContext` puts it: on CUDA on its side stream (`on`), its collective
synchronous there and its end an event the current stream waits for (`record_event`); without
streams (CPU, gloo) inline, its collective async and its end the work handle `issue` returns.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist


class CommContext:
    """Streams and retired buffers shared by every group under one root. It holds the works of
    runtime/collectives.py (`AllGatherWork`, `ReduceScatterWork`), the module that imports this one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type == "cuda"
        # The side streams of [Note: Streams without record_stream]; None without streams, where
        # the work runs inline. They live as long as the root.
        self.copy_in_stream = self.all_gather_stream = self.reduce_scatter_stream = None
        if self.uses_streams:
            self._device_module = torch.get_device_module(device.type)
            # Copies shards into all-gather inputs; waits for the current stream so it reads shards
            # after the optimizer step.
            self.copy_in_stream = self._device_module.Stream(device=device, priority=-1)
            # Runs all-gathers; high priority so prefetches are not queued behind compute.
            self.all_gather_stream = self._device_module.Stream(device=device, priority=-1)
            # Packs, reduce-scatters and divides gradients.
            self.reduce_scatter_stream = self._device_module.Stream(device=device, priority=-1)
        # All-gather buffers whose copy-out was issued, each with the current-stream event after that
        # copy-out. They die at the next all-gather, once the copy-in stream has waited the events.
        self._retired_all_gathers: list[tuple[object, object]] = []  # (AllGatherWork, event)
        # Issued reduce-scatters whose sharded gradients are not written yet, oldest first.
        self.pending_reduce_scatters: list = []  # ReduceScatterWork
        # `set_post_optim_event`: what the next copy-in waits for instead of the whole current stream.
        self.post_optim_event: Optional[torch.Event] = None

    def current_stream(self):
        """The current stream (CUDA); None without streams."""
        return self._device_module.current_stream(self.device) if self.uses_streams else None

    def on(self, stream, after=None) -> ContextManager:
        """A `with` block that runs on side stream `stream` once it has waited for the work queued on
        stream `after` (CUDA); inline without streams. See [Note: One sequence, on a stream or inline]."""
        if stream is None:
            return contextlib.nullcontext()
        if after is not None:
            stream.wait_stream(after)
        return self._device_module.stream(stream)

    def issue(self, collective: Callable[[bool], Optional[dist.Work]], async_op: bool = True) -> Optional[dist.Work]:
        """Run `collective(async_op)`, a c10d call: without streams with `async_op`, returning its
        work handle; on a side stream (CUDA) synchronously there, returning None."""
        if self.uses_streams:
            collective(False)
            return None
        return collective(async_op)

    def record_event(self, stream) -> object:
        """An event on side stream `stream` after the work queued on it (CUDA); None without streams."""
        return None if stream is None else stream.record_event()

    def retire(self, work) -> None:
        """Keep all-gather `work`'s buffers until the next all-gather's copy-in (CUDA)."""
        if self.uses_streams:
            event = self.current_stream().record_event()
            self._retired_all_gathers.append((work, event))

    def add_reduce_scatter(self, work) -> None:
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
