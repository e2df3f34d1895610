"""A communication group: the parameters of one `fully_shard` call, gathered and reduced as one bucket."""

from __future__ import annotations

import logging
from datetime import timedelta
from enum import Enum, auto
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from .bucket_layout import FLAGS, BucketLayout
from .collectives import (
    AllGatherWork,
    CommContext,
    CommHook,
    ReduceControls,
    ReduceScatterWork,
    all_gather,
    copy_out,
    prepare_all_gather,
    reduce_scatter,
)
from .custom_comms import AllGather, ProcessGroupAllocator, ReduceScatter, has_own_allocator
from .mesh_info import MeshInfo, parallelism_name
from .param import ShardedParam, hook_even_if_frozen
from .policies import MixedPrecisionPolicy
from .shard_buffer import ShardBuffer, shard_buffer_for

logger = logging.getLogger(__name__)

# What to do, told with the two reasons of gradient accumulation without sync ([Note: Groups that
# stay on the eager hooks] in traced/hooks.py): a micro-batch with sync on is a plain step, whose
# graph reduce-scatters and adds to the sharded `.grad`.
_COMPILE_WHOLE_ACCUMULATION = (
    "; the collectives run on the eager hooks and only the forwards between them compile. To compile the "
    "whole step, keep gradient sync on in every micro-batch (Accelerate: "
    "GradientAccumulationPlugin(num_steps=N, sync_each_batch=True); HF Trainer: "
    "accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': True}}; your own loop: no "
    "set_requires_gradient_sync(False)), which reduce-scatters every micro-batch's gradients"
)


class ShardedState(Enum):
    """Which parameters the owner modules hold right now."""

    SHARDED = auto()  # after construction and after `reshard()`: only the DTensor shards exist
    # After forward with an int `reshard_after_forward`: shards are registered, and a larger shard
    # (1/N of the parameters) is kept so backward gathers over N ranks only.
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()  # after the all-gather was waited and copied out: full parameters registered


class PostForwardMesh:
    """The smaller groups an int `reshard_after_forward=N` reshards to.

    Shard rank r keeps rows r % N of N equal slices of the all-gather output, and gathers them back
    from the N consecutive shard ranks of its block: those N ranks together hold every slice.
    """

    def __init__(self, mesh_info: MeshInfo, size: int) -> None:
        self.size = size
        self.position = mesh_info.shard_rank % size
        mesh_ranks = mesh_info.shard_rows_of_every_rank()
        my_block = mesh_info.shard_rank // size
        my_row = next(row for row in mesh_ranks if dist.get_rank() in row)
        self.group = None
        # `new_group` defaults to 30 minutes whatever `init_process_group(timeout=...)` said: pass
        # the shard group's, so a failed rank stops these gathers as soon as the others.
        timeout = _timeout_of(mesh_info.shard_group, mesh_info.mesh.device_type)
        # new_group is collective over the default group: every rank creates every block's group.
        for row in mesh_ranks:
            for block in range(mesh_info.shard_size // size):
                ranks = row[block * size : (block + 1) * size]
                pg = dist.new_group(ranks, timeout=timeout)
                if row is my_row and block == my_block:
                    self.group = pg


def _timeout_of(group: dist.ProcessGroup, device_type: str) -> Optional[timedelta]:
    """The collective timeout of `group` (None: unknown, `new_group` then uses its default)."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return None


class ParamGroup:
    """All-gathers, reshards and reduce-scatters the parameters of one `fully_shard` call."""

    def __init__(
        self,
        params: list[ShardedParam],
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[Union[bool, int]],
    ) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.has_tp = any(p.tp is not None for p in params)  # tensor-parallel parameters among them
        # Every (module, attribute, parameter index) that holds one of the parameters, flat: what a
        # traced step installs its gathered tensors into (`traced.install`). Owners never change.
        self.owner_slots = tuple((module, name, i) for i, p in enumerate(params) for module, name in p.owners)
        # Where each parameter lies in the group's all-gather and reduce-scatter rows, for the eager
        # collectives and the traced path alike; rebuilt by `refresh_layout` when the parameters
        # change. See [Note: One bucket layout for eager and traced steps] in runtime/bucket_layout.py.
        self.layout = BucketLayout.build(params, mesh_info.shard_size)
        # This rank's all-gather row, which the shards are views of, for the group's life (None where
        # the group keeps the copy-in); rebuilt with the layout by `refresh_shard_buffer`. See
        # [Note: Sharded parameters live in their group's row] in runtime/shard_buffer.py.
        self._pin_shard_buffer = False  # CPUOffloadPolicy(pin_memory=True): `pin_shards`
        self.shard_buffer: Optional[ShardBuffer] = shard_buffer_for(
            self.layout, params, None, on_hand_out=self.compiled_grads_handed_out
        )
        self.device = device
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward  # None until the root is known
        self.post_forward_mesh: Optional[PostForwardMesh] = None
        self.name = "<unnamed>"  # the module FQN(s), set when a root claims the group, for logs and profiler ranges
        self.comm: Optional[CommContext] = None  # the root's, set when a root claims the group

        self.state = ShardedState.SHARDED
        self._all_gather: Optional[AllGatherWork] = None  # issued, not yet copied out
        self._post_forward_shard: Optional[torch.Tensor] = None  # lives from forward to re-gather

        # User controls, as in FSDP2.
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: Optional[float] = None
        self.comm_hook: Optional[CommHook] = None  # replaces the reduce-scatter (FSDP1 comm hooks)
        self.reduce_controls = ReduceControls()  # all-reduce on/off, all-reduce hook, forced sums
        self.unshard_in_backward = True  # False: backward needs none of these parameters (FSDP2)
        self.custom_all_gather: Optional[AllGather] = None  # replace the collectives (FSDP2's API)
        self.custom_reduce_scatter: Optional[ReduceScatter] = None
        # `set_allocate_memory_from_process_group_for_comm`: the eager collectives' buffers come from
        # the process group's allocator (where its backend has one: `ProcessGroupAllocator`).
        self.allocate_from_process_group = False
        self.uses_process_group_allocator = False  # ... and the backend has one (read when tracing)
        # Unsharded gradients kept unreduced by a backward without sync (accumulation), until a
        # backward with sync reduces them together with its own.
        self.holds_unreduced_grads = False

        # Called once every trainable gradient of a backward has accumulated; the root sets it to
        # reduce the groups in an order all ranks share (runtime/state.py, RootContext).
        self.on_all_grads_ready: Callable[[], None] = self.post_backward
        # Whether the running backward writes any parameter's `.grad` under the root; the root sets
        # it. See [Note: A backward that writes no parameter gradient] in runtime/state.py.
        self.backward_writes_param_grads: Callable[[], bool] = lambda: True

        # Per-backward bookkeeping, reset by `reset_backward_state`.
        self._num_grads_ready = 0
        self.reduced_this_backward = False
        # Forward calls (with inputs that need a gradient) whose backward has not reached their
        # inputs yet; counted for groups with frozen parameters, and for calls that ran on the eager
        # hooks inside a compiled step. See [Note: Frozen parameters outlive the gradients].
        self._num_input_grads_pending = 0
        # A call ran on the eager hooks inside a compiled step, and then every call's backward reached
        # its inputs: see [Note: A fallback group's backward ends at its inputs].
        self._reduces_at_inputs = False
        self._inputs_reached = False

    @property
    def world(self) -> int:
        return self.mesh_info.shard_size

    @property
    def num_trainable(self) -> int:
        """The trainable parameters as of the last gather ([Note: Parameters changed after fully_shard])."""
        return self.layout.num_trainable

    def refresh_layout(self) -> BucketLayout:
        """The group's `BucketLayout`, rebuilt first where a parameter's requires_grad, dtype or
        all-gather extensions changed since it was built ([Note: Parameters changed after
        fully_shard] in runtime/param.py). Called where an eager gather of a sharded group begins,
        and by `follow_registered_params` before every trace, which then reads `layout` as it is
        ([Note: Tracing reads what was followed] in traced/callbacks.py)."""
        if BucketLayout.inputs_of(self.params) != self.layout.built_from:
            self.layout = BucketLayout.build(self.params, self.world)
        return self.layout

    def refresh_shard_buffer(self) -> Optional[ShardBuffer]:
        """The group's shard buffer for its current layout, after the parameters were followed:
        replaced shards copied in and viewed again, rebuilt where the layout, dtype or device
        changed. Eager only (a trace reads the buffer, never writes it): the eager unshard, and
        `follow_registered_params`, which runs before Dynamo traces."""
        before = self.shard_buffer
        self.shard_buffer = shard_buffer_for(
            self.layout, self.params, before, self._pin_shard_buffer, on_hand_out=self.compiled_grads_handed_out
        )
        if self.shard_buffer is not before:
            reason = ShardBuffer.reason_not(self.layout, self.params) if self.shard_buffer is None else None
            logger.debug("fsdp_graph::shard_buffer (%s): %s", self.name, f"none, copies in: {reason}"
                         if reason else f"{self.shard_buffer.flat.numel()} elements, gathered in place")
        return self.shard_buffer

    def pin_shards(self) -> None:
        """`CPUOffloadPolicy(pin_memory=True)`: pin the CPU shards: the shard buffer where the group
        has one (its dim-0 shards are views of it), and each shard with storage of its own."""
        self._pin_shard_buffer = True
        if self.shard_buffer is not None:
            self.shard_buffer = ShardBuffer(
                self.layout, self.params, pin_memory=True, on_hand_out=self.compiled_grads_handed_out
            )
        for p in self.params:
            if self.shard_buffer is None or not ShardBuffer.viewable(p):
                p.pin_shard()  # a shard with its own storage
            p.pinned = True

    def set_reshard_after_forward(self, value: Union[bool, int]) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            if value == self.world:
                value = True
            elif value == 1:
                value = False
            elif self.post_forward_mesh is None or self.post_forward_mesh.size != value:
                self.post_forward_mesh = PostForwardMesh(self.mesh_info, value)
        self.reshard_after_forward = value

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue this group's all-gather unless it is unsharded or already in flight."""
        if self.state is ShardedState.UNSHARDED or self._all_gather is not None:
            return
        with torch.profiler.record_function(f"fsdp_graph::all_gather ({self.name})"):
            logger.debug("fsdp_graph::all_gather (%s) async=%s", self.name, async_op)
            if self.state is ShardedState.SHARDED_POST_FORWARD:
                mesh = self.post_forward_mesh
                self._all_gather = all_gather(
                    self.layout, self.params, mesh.group, mesh.size, self.comm, async_op,
                    input=self._post_forward_shard, comm=self.custom_all_gather,
                    allocator=self._allocator(mesh.group),
                )
            else:
                layout = self._refresh_for_gather()
                self._all_gather = all_gather(
                    layout, self.params, self.mesh_info.shard_group, self.world, self.comm,
                    async_op, comm=self.custom_all_gather, allocator=self._allocator(self.mesh_info.shard_group),
                    shard_buffer=self.refresh_shard_buffer(),
                )

    def prepare_all_gather(self) -> AllGatherWork:
        """This group's bucket with its shards copied in, for a replay to issue in the compiled
        graph's collectives ([Note: A compiled graph's buckets on the eager hooks] in
        runtime/collectives.py); waited as `unshard`'s all-gather is. The group must be sharded."""
        layout = self._refresh_for_gather()
        self._all_gather = prepare_all_gather(
            layout, self.params, self.mesh_info.shard_group, self.world, self.comm, self.refresh_shard_buffer()
        )
        return self._all_gather

    def _refresh_for_gather(self) -> BucketLayout:
        """Take up what changed in the sharded parameters since the last gather; their layout."""
        for p in self.params:
            p.follow_registered_param()  # [Note: The sharded parameter is the one its module holds]
            p.check_gatherable()
            p.refresh_gather_hooks()  # [Note: Extensions found on the tensor instance]
        return self.refresh_layout()

    def compiled_grads_handed_out(self) -> None:
        """The shard buffer gave the parameters a compiled backward's gradients: finish the group's
        backward at its end: the layer above does, where steps run in a graph
        (traced/unshard.py, [Note: Flags that need no reading])."""

    def follow_registered_params(self) -> None:
        """Take the sharded parameters the modules hold now (replaced, or converted by `_apply`:
        `to_empty()`, `.to()`), with our hooks. A no-op while the group is gathered (the modules hold the
        unsharded parameters). See [Note: The sharded parameter is the one its module holds] in
        runtime/param.py."""
        if self.state is ShardedState.UNSHARDED:
            return
        for p in self.params:
            p.follow_registered_param()
        if self.state is ShardedState.SHARDED:  # a post-forward shard keeps the layout it was cut in
            self.refresh_layout()
            self.refresh_shard_buffer()

    def wait_for_unshard(self) -> None:
        """Wait for the issued all-gather, copy out, and register the unsharded parameters."""
        work = self._all_gather
        if work is None:
            return
        with torch.profiler.record_function(f"fsdp_graph::copy_out ({self.name})"):
            work.wait(self.comm)
            new_params = [p.unsharded_param is None for p in self.params]
            copy_out(self.params, work, self.world)
            self.comm.retire(work)
            self._all_gather = None
            self._post_forward_shard = None
            for p, is_new in zip(self.params, new_params):
                unsharded = p.unsharded_param
                if is_new:
                    hook_even_if_frozen(unsharded, lambda t: t.register_post_accumulate_grad_hook(self._on_grad_ready))
                if unsharded.requires_grad != p.requires_grad:  # [Note: Parameters changed after fully_shard]
                    unsharded.requires_grad_(p.requires_grad)
                p.install(sharded=False)
            self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters and register the shards. A no-op when already sharded."""
        if self._all_gather is not None:  # a prefetch nobody used
            self._all_gather.wait(self.comm)
            self.comm.retire(self._all_gather)
            self._all_gather = None
        if self.state is ShardedState.SHARDED:
            return
        logger.debug("fsdp_graph::reshard (%s)", self.name)
        self._post_forward_shard = None
        for p in self.params:
            p.free_unsharded()
            p.install(sharded=True)
        self.state = ShardedState.SHARDED

    def post_forward_reshard(self, full: bool = False) -> None:
        """Reshard as `reshard_after_forward` says: fully, to the smaller group, or not at all.
        `full`: an int reshards fully too, as a traced graph does."""
        if self.state is not ShardedState.UNSHARDED or self.reshard_after_forward is False:
            return
        if self.reshard_after_forward is True or full or self.layout.as_bytes:
            # A smaller group's re-gather reuses the gathered rows of one dtype; all-gather
            # extensions rebuild their parameters from the pre-hook's inputs instead, and mixed
            # dtypes have no one dtype, so byte buckets reshard fully.
            self.reshard()
            return
        mesh = self.post_forward_mesh
        rows = range(mesh.position * self.world // mesh.size, (mesh.position + 1) * self.world // mesh.size)
        layout = self.layout
        # The all-gather rows this rank keeps, rebuilt from the gathered parameters: row r is what
        # rank r's copy-in made, so each is `fsdp_graph::copy_in` of the parameters' slot r.
        gathered = {i: self.params[i].gathered_rows(self.world) for i in layout.blocks if i != FLAGS}
        shard = torch.empty(len(rows), sum(layout.widths), dtype=layout.dtype, device=self.device)
        empty = shard.new_empty(0)  # the flags' columns: zeros
        with torch.no_grad():
            for j, r in enumerate(rows):
                pieces = [empty if i == FLAGS else gathered[i][r] for i in layout.blocks]
                torch.ops.fsdp_graph.copy_in.out(pieces, layout.widths, out=shard[j])
        self.reshard()
        self._post_forward_shard = shard.reshape(-1)
        self.state = ShardedState.SHARDED_POST_FORWARD

    # -- backward ------------------------------------------------------------------------------

    @property
    def all_grads_ready(self) -> bool:
        """Every trainable parameter's gradient has accumulated this backward (on this rank), or no
        more will: [Note: A fallback group's backward ends at its inputs]."""
        return self._num_grads_ready >= self.num_trainable or self._inputs_reached

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self._num_grads_ready += 1
        if self._num_grads_ready == self.num_trainable:
            self.on_all_grads_ready()

    def parallelism_names(self) -> frozenset[str]:
        """The names (`parallelism_name`) of the process groups this group's collectives run on."""
        separate = self.reduce_controls.reduce_scatter_group
        return self.mesh_info.parallelism_names() | ({parallelism_name(separate)} if separate is not None else set())

    def post_backward(
        self, issue: bool = True, all_reduce_later: bool = False
    ) -> Optional[ReduceScatterWork]:
        """Reduce-scatter this group's unsharded gradients (once per backward) and reshard; returns
        the reduce-scatter, if there was one. With `issue` False the gradients are only packed, and
        the caller issues the work in the compiled graph's collectives ([Note: A compiled graph's
        buckets on the eager hooks] in runtime/collectives.py); with `all_reduce_later`, HSDP's
        all-reduce waits for that graph's turn too (`ReduceScatterWork.issue_replica_all_reduce`).

        Every rank reduce-scatters every trainable parameter, whether or not it has a gradient
        here: see [Note: Every rank packs every parameter] in runtime/collectives.py.
        """
        if self.reduced_this_backward:
            return None
        self.reduced_this_backward = True
        work = None
        with torch.profiler.record_function(f"fsdp_graph::post_backward ({self.name})"):
            logger.debug("fsdp_graph::post_backward (%s)", self.name)
            trainable = [self.params[i] for i in self.layout.reduced]
            if trainable and self.requires_gradient_sync and self._nothing_to_reduce(trainable):
                logger.debug("fsdp_graph::post_backward (%s): this backward writes no parameter gradient", self.name)
            elif trainable and self.requires_gradient_sync:
                # The previous group's reduce-scatter had this group's backward to finish: wait
                # for it first, so at most one packed gradient buffer is alive at a time.
                self.comm.finish_reduce_scatters(but_waiting=True)
                factor = self.gradient_divide_factor or self.world * self.mesh_info.replicate_size
                work = reduce_scatter(
                    self.layout, self.params, self.mesh_info, self.mp_policy.reduce_dtype, factor, self.comm,
                    self.comm_hook, self.reduce_controls, self.custom_reduce_scatter,
                    self._allocator(self.reduce_controls.reduce_scatter_group or self.mesh_info.shard_group),
                    issue=issue, all_reduce_later=all_reduce_later,
                )
                if issue:
                    self.comm.add_reduce_scatter(work)
                self.holds_unreduced_grads = False
            elif any(p.has_unsharded_grad for p in trainable):
                self.holds_unreduced_grads = True
                for p in trainable:  # FSDP2 accumulates unreduced gradients in reduce_dtype
                    p.accumulate_unreduced_grad(self.mp_policy.reduce_dtype)
            if self.reshard_after_backward and self._num_input_grads_pending == 0:
                self.reshard()
        return work

    # [Note: Frozen parameters outlive the gradients]
    # A trainable parameter's gradient accumulates only after every backward op that saved the
    # parameter ran (the op computes the input's and the parameter's gradient together), so once all
    # of a group's gradients are here, no trainable parameter is read again. A frozen parameter has
    # no gradient to say so: in a LoRA block `adapter(frozen(x))` the adapter's gradients are ready
    # while the gradient of `x` still needs the frozen weight. So for a group with frozen parameters
    # each forward call whose inputs need a gradient routes them through `InputGradsDone`, whose
    # backward runs once the call's backward reached its inputs (FSDP2 resharding hooks its inputs
    # the same way), and the group reshards only when every such call got there and its gradients
    # are reduced (frozen-only groups: when the calls got there). A call whose inputs need no
    # gradient has no backward op left that reads the group once its gradients are here. A forward
    # without a backward leaves a call pending: the group then reshards at the end of the next
    # backward, which resets the count.

    # [Note: A fallback group's backward ends at its inputs]
    # A group reduces once all its trainable gradients are here, or else at the end of backward
    # ([Note: One order of reduce-scatters on every rank] in runtime/state.py). In a routed block (an
    # MoE's router and experts in one group) an expert that gets no tokens on one rank gets no
    # gradient there, so that rank's group waits for the end of backward while a rank whose experts
    # all got tokens reduces at once. On the eager hooks alone the other groups wait behind it on
    # every rank, but where the group's call fell back inside a compiled step, the groups before it
    # are traced, and their graph's backward issues their reduce-scatters at once: the ranks met
    # with different collectives and waited for ever. Its graph would reduce the group where its
    # backward ends, gradients or not, so a call that ran on the eager hooks inside a compiled call
    # routes its inputs through `InputGradsDone` as frozen groups do, and once every call's backward
    # reached its inputs the group counts as ready: no gradient of its own can come after that (the
    # engine accumulates a parameter's gradient before it runs anything that waits on the op that
    # made it). A rank whose gradients all came reduced it a moment earlier, with no collective in
    # between. Not covered: a call whose inputs need no gradient has no such point, and its group
    # reduces as before (all gradients here, or the end of backward); a parameter of the group read
    # outside its calls would give its gradient too late.

    def expect_input_grads(self, reduces_at_inputs: bool = False) -> None:
        """A forward call whose inputs need a gradient: hold the reshard until `input_grads_done`.
        `reduces_at_inputs`: the call ran on the eager hooks inside a compiled call, and the group
        reduces once every call's backward reached its inputs ([Note: A fallback group's backward
        ends at its inputs])."""
        self._num_input_grads_pending += 1
        self._reduces_at_inputs |= reduces_at_inputs

    def input_grads_done(self) -> None:
        """A forward call's backward reached its inputs; reduce (a fallback's group) and reshard if
        it was the last one pending."""
        self._num_input_grads_pending -= 1
        if self._num_input_grads_pending == 0 and self._reduces_at_inputs and not self.reduced_this_backward:
            self._inputs_reached = True
            if self.num_trainable:
                self.on_all_grads_ready()
        if (
            self._num_input_grads_pending == 0
            and (self.reduced_this_backward or self.num_trainable == 0)
            and self.reshard_after_backward
        ):
            self.reshard()

    def zero_grads_of_unused_group(self) -> None:
        """`set_reduce_scatter_unused_params(True)` on a group that did not run this backward: FSDP2
        reduces its trainable parameters (those gathered before) at the end of backward as zeros.
        The result is zeros on every rank, so it is written without a collective."""
        if self.reduced_this_backward or not self.requires_gradient_sync or not self.backward_writes_param_grads():
            return
        for p in self.params:
            if p.requires_grad and p.unsharded_param is not None:
                p.accumulate_sharded_grad(p.local_shard.new_zeros(p.shard_numel))

    def _nothing_to_reduce(self, trainable: list[ShardedParam]) -> bool:
        """No rank has a gradient of this group to reduce: [Note: A backward that writes no
        parameter gradient] in runtime/state.py. Asks the root only when this rank has none; a
        group on one rank alone (expert weights with as many expert-parallel ranks as data-parallel
        ones) needs no one's agreement, and skips a backward that gave it no gradient, as FSDP2 does
        (torchtitan's chunked loss runs one backward per chunk before the body's)."""
        if self.holds_unreduced_grads or self.reduce_controls.partial is not None:
            return False
        if any(p.has_unsharded_grad for p in trainable):
            return False
        if self.world * self.mesh_info.replicate_size == 1 and not self.reduce_controls.zeros_for_unused:
            return True  # no other rank joins this group's collectives: this rank's gradients decide
        return not self.backward_writes_param_grads()

    def set_separate_reduce_scatter_group(self, enable: bool, made: dict) -> None:
        """Reduce-scatter on a new process group over the shard ranks (`made`: ranks -> group, so
        groups over the same ranks share one). Collective over those ranks."""
        if not enable:
            self.reduce_controls.reduce_scatter_group = None
            return
        ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_group))
        if ranks not in made:
            timeout = _timeout_of(self.mesh_info.shard_group, self.mesh_info.mesh.device_type)
            made[ranks] = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
        self.reduce_controls.reduce_scatter_group = made[ranks]

    def _allocator(self, group: dist.ProcessGroup) -> Optional[ProcessGroupAllocator]:
        return ProcessGroupAllocator(group) if self.allocate_from_process_group else None

    def process_group_allocates(self) -> bool:
        """Whether `allocate_from_process_group` changes anything: a shard group with its own allocator."""
        return self.allocate_from_process_group and has_own_allocator(self.mesh_info.shard_group, self.device)

    def eager_only_reason(self) -> Optional[str]:
        """Why this group cannot be traced into a graph right now, or None. See traced/hooks.py,
        [Note: Groups that stay on the eager hooks]."""
        if self.comm_hook is not None:
            return "a comm hook is registered (fsdp_graph.fsdp1.comm_hooks); hooks run on the eager runtime"
        if not self.requires_gradient_sync:
            return ("gradient sync is off (no_sync / set_requires_gradient_sync(False)): accumulating unreduced "
                    f"gradients{_COMPILE_WHOLE_ACCUMULATION}")
        if self.holds_unreduced_grads:
            return f"it holds gradients accumulated without sync, which this backward reduces{_COMPILE_WHOLE_ACCUMULATION}"
        if self.mesh_info.is_hsdp and not self.reduce_controls.all_reduce:
            return "set_requires_all_reduce(False): keeping reduce-scattered sums without the replica all-reduce"
        if self.reduce_controls.partial is not None:
            return "it holds reduce-scattered sums (set_requires_all_reduce(False)) which this backward all-reduces"
        if self.reduce_controls.all_reduce_hook is not None:
            return "an all-reduce hook is set (set_all_reduce_hook); hooks run on the eager runtime"
        if self.custom_all_gather is not None or self.custom_reduce_scatter is not None:
            return "a custom all-gather or reduce-scatter is set; custom comms run on the eager runtime"
        if self.uses_process_group_allocator:
            return (
                "set_allocate_memory_from_process_group_for_comm(True) on a backend with its own allocator: "
                "the eager collectives allocate from it, a graph allocates its buffers itself"
            )
        if not self.unshard_in_backward:
            return "set_unshard_in_backward(False): the graph's backward reads the gathered parameters"
        return None

    def reset_backward_state(self) -> None:
        self._num_grads_ready = 0
        self.reduced_this_backward = False
        self._num_input_grads_pending = 0
        self._reduces_at_inputs = False
        self._inputs_reached = False
