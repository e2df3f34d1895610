"""One sharded parameter: its DTensor shard, where it lives in the module tree, and its unsharded view.

Layout, for a parameter sharded on dim k (`Shard(k)`, 0 by default) on a shard group of `world` ranks.
Everything below is said of the parameter with dim k moved first, `param.movedim(k, 0)`, of shape
(dim0, *rest); for k = 0 that is the parameter itself:

    padded_dim0 = ceil(dim0 / world)        rows each rank owns, padding included
    rank r owns rows [r * padded_dim0, (r + 1) * padded_dim0) clipped to dim0

so a rank's valid rows are a prefix of its padded slot, possibly empty. This is `torch.chunk`'s split,
which is also what DTensor's `Shard(0)` means for uneven sizes. In the all-gather buffer each rank
contributes `shard_numel = padded_dim0 * prod(rest)` elements per parameter, padding as zeros.

[Note: Sharding on another dim]
For k > 0 the collectives still move whole rows of the moved layout: copy-in flattens
`shard.movedim(k, 0)` (a copy), the gathered rows are the moved parameter, and copy-out copies them
back with `movedim(0, k)` into a contiguous unsharded parameter, so the module computes on the same
layout as the unsharded model; gradients are packed from `grad.movedim(k, 0)` (`shard_dim_first`).
The DTensor shard is `Shard(k)`: rank r's slice of dim k, which is the same chunking moved back.

Beside it: the mesh it is sharded over (runtime/mesh_info.py), a tensor-parallel parameter's layout
and its tp DTensor (runtime/tp_layout.py), the all-gather extensions a shard may bring
(runtime/all_gather_extensions.py, which `ShardedParam` inherits), and freeing and refilling storage
(runtime/storage.py).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .all_gather_extensions import AllGatherExtensions
from .mesh_info import MeshInfo
from .policies import MixedPrecisionPolicy
from .storage import contiguous_stride, refill
from .tp_layout import sharded_layout, tensor_parallel_layout


# Set on every sharded parameter, and on each original parameter `fully_shard` took, naming its
# `ShardedParam`: a later `fully_shard` meeting a tied weight, the optimizer check and the backend
# read it. See [Note: The sharded parameter is the one its module holds].
OWNER_ATTR = "_fsdp_graph_param"


class MetaParameterError(ValueError, RuntimeError):
    """Parameters still on the meta device when a forward needs them.

    A ValueError like our other user mistakes, and a RuntimeError, the type FSDP2 raises here, so
    code written against either catches it.
    """

    def __init__(self, fqns: list[str]) -> None:
        super().__init__(
            f"Parameters {fqns} are still on the meta device; materialize and initialize the model "
            f"before its first forward: model.to_empty(device=...), then initialize the parameters "
            f"(e.g. call reset_parameters() on each module that has one)"
        )


class ShardedParam(AllGatherExtensions):
    """Owns one parameter of a group from `fully_shard` until the module dies.

    The sharded parameter (an `nn.Parameter` holding a DTensor) is what the optimizer, `state_dict`
    and the user see between steps. The unsharded parameter is a plain `nn.Parameter` that autograd
    records during forward; its storage is allocated on unshard and freed on reshard, so tensors
    autograd saved for backward refill when the group is gathered again.
    """

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        fqn: str,
        group_modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        device: torch.device,
        shard_device: torch.device,
        param_dtype: torch.dtype | None,
        shard_dim: int = 0,
        mp_policy: MixedPrecisionPolicy | None = None,
        spmd_axes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
    ) -> None:
        self.owners = owners  # every (module, attribute) that holds this parameter (tied weights)
        self.fqn = fqn
        self.group_modules = group_modules  # the modules of the fully_shard call that took it
        self.mesh_info = mesh_info
        self.device = device  # where unsharded parameters live
        self.shard_device = shard_device  # where the shard lives: `device`, or CPU when offloading
        self.orig_size = param.size()  # the global shape, for a tensor-parallel parameter too
        # The dtype the module computes with when it is not the shard's: see `unsharded_dtype`.
        self.param_dtype = param_dtype
        local = self._init_sharded_param(param, shard_dim, spmd_axes)
        self._installed = False  # until `install` first registers it on the owners
        # (id, TensorImpl) of the sharded parameter when it was last followed: a new object, or
        # the same one after `torch.utils.swap_tensors`, has lost our hooks and attribute.
        self._followed: tuple[int, int] | None = None
        # See [Note: All-gather extensions] in runtime/all_gather_extensions.py.
        self._init_all_gather_extensions(mp_policy, type(local))
        # Whether the last compiled backward accumulated into this parameter (`grad_seen`), and if
        # so whether `.grad` was None just before; see [Note: Gradient flags in a graph] in
        # traced/unshard.py.
        self.grad_seen = False
        self.grad_was_none = False
        self._watching_grad = False
        self._watch_handle = None  # our hook in the sharded parameter's hook dict
        # Called when a module registers another parameter in this one's place (the root counts it):
        # see `_note_parameter_registered`.
        self.on_replaced: Callable[[], None] = lambda: None
        _watch_parameter_registrations()

        # Unsharded storage, padded to world * padded_dim0 rows so the all-gather output copies out
        # in one `split_with_sizes_copy`; the parameter autograd sees is a view of its first dim0
        # rows. Its storage is empty whenever the group is sharded.
        self._unsharded_padded: torch.Tensor | None = None
        # The unsharded tensor this rank computes with (plain); `unsharded_param` is it, or, for a
        # tensor-parallel parameter, a tp DTensor around it. Both live from the first gather on.
        self._unsharded_local: torch.Tensor | None = None
        self.unsharded_param: nn.Parameter | None = None
        # Gradients accumulated without sync, upcast to reduce_dtype: see `accumulate_unreduced_grad`.
        self.unreduced_grad: torch.Tensor | None = None
        # CPU offload with pinned memory: gradients come to the host with a non-blocking copy, which
        # `wait_host_copy` (or the end of the backward) waits for before anything reads them.
        self.pinned = False
        self.host_copy_pending = False

    # -- sharded side --------------------------------------------------------------------------

    def _init_sharded_param(
        self, param: nn.Parameter, shard_dim: int, spmd_axes: tuple[tuple[int, ...], tuple[int, ...]]
    ) -> torch.Tensor:
        """Lay out this rank's rows of `param` (the module docstring's layout) and make the sharded
        parameter of them; returns its local tensor."""
        # See [Note: Sharding a tensor-parallel parameter] in runtime/tp_layout.py: below, `param` is the
        # tp-local tensor. `spmd_axes`: the shard and replicate axes of `dp_mesh_dims` on the
        # parameter's own mesh ([Note: Parameters on the whole SPMD mesh]).
        self.tp = tensor_parallel_layout(param, spmd_axes)
        if self.tp is not None:
            param = param.to_local()
        self.local_size = param.size()  # the shape the module computes with on this rank
        self.shard_dim = shard_dim
        self.sharded_mesh, self.placements = sharded_layout(self.mesh_info, shard_dim, self.tp)
        # The shape of the parameter with the shard dim first, the layout the collectives move.
        self.moved_size = param.movedim(shard_dim, 0).size()

        world, rank = self.mesh_info.shard_size, self.mesh_info.shard_rank
        dim0 = self.moved_size[0]
        self.row_numel = math.prod(self.moved_size[1:])
        self.padded_dim0 = math.ceil(dim0 / world)
        self.shard_numel = self.padded_dim0 * self.row_numel
        self.row_start = min(rank * self.padded_dim0, dim0)  # this rank's first row of the full tensor
        self.num_valid_rows = min(self.padded_dim0, dim0 - self.row_start)

        local = self.own_rows(param.detach())
        local = local.clone() if local.is_meta else local.to(self.shard_device, copy=True)
        local = local.contiguous()
        # The sharded parameter as last followed; `sharded_param` is the one the module holds now.
        self.followed_param = nn.Parameter(self._to_dtensor(local), requires_grad=param.requires_grad)
        return local

    def pin_shard(self) -> None:
        """Pin the (CPU-offloaded) shard in page-locked memory: its copies to the GPU can overlap.
        A shard living in its group's buffer is pinned with the buffer instead
        (`ParamGroup.pin_shards`)."""
        if not self.local_shard.is_meta:
            pinned = self.local_shard.pin_memory()
            self.followed_param = nn.Parameter(self._to_dtensor(pinned), requires_grad=self.requires_grad)
        self.pinned = True

    def live_in(self, view: torch.Tensor) -> None:
        """Make `view`, this shard's slot in its group's shard buffer (of the local tensor's shape),
        the sharded parameter's local tensor, with its values, as FSDP2 points a replaced shard's
        local tensor at its padded storage. The parameter object stays (its identity, hooks and
        `.grad`), so the optimizer's state and the module keep it. See [Note: Sharded parameters
        live in their group's row] in runtime/shard_buffer.py."""
        param = self.sharded_param
        view.copy_(param._local_tensor)
        # A DTensor records its local tensor's storage offset, and Dynamo fakes a parameter whose
        # local tensor disagrees with it wrongly: `.data =` takes the metadata of a DTensor built on
        # the view (the tensor object, its autograd hooks and `.grad` stay), then the view itself
        # becomes the local tensor.
        param.data = self._to_dtensor(view)
        param._local_tensor = view

    def _to_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local,
            self.sharded_mesh,
            self.placements,
            run_check=False,
            shape=self.orig_size,
            stride=contiguous_stride(self.orig_size),
        )

    # [Note: Parameters changed after fully_shard]
    # Between steps the user may freeze or unfreeze a sharded parameter (`requires_grad_`) or convert
    # the module (`model.to(torch.float64)`, which converts the shards in place). As in FSDP2, both
    # are read from the sharded parameter itself, never from what it was at fully_shard:
    # `requires_grad` and `orig_dtype` below. Each unshard in a pre-forward re-reads them
    # (`ParamGroup.unshard`): the group recounts its trainable parameters, the unsharded parameter
    # takes the shard's requires_grad, and one of another dtype is allocated anew. Gradient hooks are
    # registered on every parameter whatever its requires_grad (`hook_even_if_frozen`), since they
    # stay through later `requires_grad_` calls. The compiled path reads the same properties while
    # Dynamo traces, and Dynamo guards on each parameter's requires_grad and dtype, so a change
    # recompiles. The shards' dtype is the all-gather and reduce dtype unless the
    # MixedPrecisionPolicy names one.

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    @property
    def orig_dtype(self) -> torch.dtype:
        """The shard's dtype now (it follows `model.to(dtype)`)."""
        return self.sharded_param.dtype

    @property
    def unsharded_dtype(self) -> torch.dtype:
        """The dtype of the unsharded parameter: the policy's param_dtype, else the shard's."""
        return self.param_dtype or self.orig_dtype

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's valid rows of the sharded parameter (no padding), in the parameter's layout."""
        return self.sharded_param.to_local()

    def flat_local_shard(self) -> torch.Tensor:
        """`local_shard` in the moved layout, flat: this rank's piece of the all-gather input."""
        return self.shard_dim_first(self.local_shard).reshape(-1)

    def shard_dim_first(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, in the parameter's layout, with the shard dim moved first (`shard_dim_first`)."""
        return shard_dim_first(t, self.shard_dim)

    # [Note: The sharded parameter is the one its module holds]
    # Users and frameworks change parameters after `fully_shard`: `load_state_dict(sd, assign=True)`
    # and `set_model_state_dict(..., broadcast_from_rank0=True)` put new DTensors in place (HF's and
    # Accelerate's meta-device loading), `module.weight = nn.Parameter(...)` replaces one, and
    # `to_empty()`, `.to()` and `.float()` convert DTensor parameters with `torch.utils.swap_tensors`,
    # which keeps the Python object but gives it a new TensorImpl: the tensor's hooks and Python
    # attributes stay with the old one. So nothing here trusts an identity or a hook from
    # `fully_shard` time:
    # - `sharded_param` is whatever the first owner module holds now (once installed), so eager steps
    #   read the new tensor even before anything followed it. While Dynamo traces it is the followed
    #   one (a lookup per access made tracing a quarter slower); a parameter assigned between
    #   compiled steps is counted by a parameter registration hook, the traced root guards the
    #   count, and the recompile follows it first.
    # - `follow_registered_param` checks a replacement, registers it on every owner (tied weights),
    #   and puts back what the tensor lost: our attribute and the gradient watch of [Note: Gradient
    #   flags in a graph]. It runs wherever the runtime gets control before parameters are read:
    #   the root's pre-forward (FSDP2's lazy init) and every unshard, after `_apply` and
    #   `load_state_dict`, before Dynamo compiles a frame, and at the end of every backward.
    # - The watch only ever removes a gradient it saw created by a compiled backward (`grad_seen`);
    #   a parameter whose watch was lost keeps its gradient.

    @property
    def sharded_param(self) -> nn.Parameter:
        """The sharded parameter: the DTensor the first owner module holds now, else (the module
        holds the unsharded parameter, or full ones inside `summon_full_params`) the last one
        followed. While Dynamo traces, the last one followed: the trace began by following every
        parameter (see the note above)."""
        if torch.compiler.is_compiling():
            return self.followed_param
        replacement = self.replacement()
        return replacement if isinstance(replacement, DTensor) else self.followed_param

    def replacement(self) -> torch.Tensor | None:
        """What the first owner module holds in place of the sharded parameter, if anything else
        than our sharded or unsharded parameter (None before `fully_shard` installed it)."""
        if not self._installed:
            return None
        module, name = self.owners[0]
        live = module._parameters.get(name)
        if live is self.followed_param or live is None or live is self.unsharded_param:  # the usual case first
            return None
        return live

    def follow_registered_param(self) -> None:
        """Take the sharded parameter the module holds now, and give it back our attribute and
        gradient watch if it lost them. See [Note: The sharded parameter is the one its module holds]."""
        replacement = self.replacement()
        if replacement is not None:
            self._check_replacement(replacement)
            self.followed_param = replacement
            self.install(sharded=True)  # every owner of a tied weight
        current = self.followed_param
        if self._followed != (id(current), current._cdata):
            self._followed = (id(current), current._cdata)
            setattr(current, OWNER_ATTR, self)
            if self._watching_grad:
                self._watch(current)

    def replacement_problem(self, current: torch.Tensor, name: str | None = None) -> str | None:
        """Why `current`, put in place of the sharded parameter, cannot be one; None if it can.
        `name`: the parameter's name in the message (its name in the group's module by default)."""
        name = self.fqn if name is None else name
        if not isinstance(current, DTensor) or tuple(current.placements) != self.placements:
            placements = tuple(current.placements) if isinstance(current, DTensor) else None
            return (
                f"Parameter '{name}' was replaced by a {type(current).__name__}"
                + (f" with placements {placements}" if placements is not None else "")
                + f", not a DTensor sharded with {self.placements}; load sharded state with "
                f"model.load_state_dict(...) (without assign=True), or assign DTensors made with "
                f"distribute_tensor(full, param.device_mesh, param.placements)"
            )
        if current.size() != self.orig_size:
            return (
                f"Parameter '{name}' was replaced by a DTensor of shape {tuple(current.size())}, "
                f"expected {tuple(self.orig_size)}"
            )
        if current.device_mesh != self.sharded_mesh:
            return (
                f"Parameter '{name}' was replaced by a DTensor on mesh {current.device_mesh}, "
                f"expected {self.sharded_mesh}; distribute it over the parameter's own device_mesh"
            )
        return None

    def _check_replacement(self, current: torch.Tensor) -> None:
        problem = self.replacement_problem(current)
        if problem is not None:
            raise ValueError(problem)

    def check_gatherable(self) -> None:
        """Before a gather: follow the sharded parameter's dtype, and refuse meta shards.

        See [Note: Parameters changed after fully_shard]: an unsharded parameter of another dtype
        than the one now wanted is dropped, and the next copy-out allocates it anew.
        """
        param = self.sharded_param
        if self._unsharded_padded is not None and self._unsharded_padded.dtype != self.unsharded_dtype:
            self._unsharded_padded = self._unsharded_local = self.unsharded_param = None
        if param.is_meta:  # the root checked every group first; see `FSDPState.check_materialized`
            raise MetaParameterError([self.fqn])

    def watch_grad_before_backward(self) -> None:
        """Record, each time autograd is about to accumulate into the sharded parameter, that it
        did (`grad_seen`) and whether its `.grad` was None (`grad_was_none`)."""
        self._watching_grad = True
        self._followed = None  # registered by following
        self.follow_registered_param()

    def note_grad_arriving(self, param: nn.Parameter) -> None:
        """Record that a gradient is about to accumulate into `param` (`grad_seen`) and whether its
        `.grad` is None now (`grad_was_none`): the watch's hook in eager steps, the shard buffer's
        in compiled ones ([Note: Compiled gradients arrive as the row's] in runtime/shard_buffer.py)."""
        self.grad_seen = True
        self.grad_was_none = param.grad is None

    def _watch(self, param: nn.Parameter) -> None:
        def record(grad: torch.Tensor) -> torch.Tensor:
            self.note_grad_arriving(param)
            return grad

        if self._watch_handle is not None:
            self._watch_handle.remove()
        hooks = param._backward_hooks
        if hooks is not None:
            # `swap_tensors` left the hook dict on the Python object, no longer linked to the new
            # TensorImpl (a new hook would join a dict autograd never reads): setting it links it.
            param._backward_hooks = hooks
        handles = []
        hook_even_if_frozen(param, lambda t: handles.append(t.register_hook(record)))
        self._watch_handle = handles[0] if handles else None

    def own_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's valid rows (on the shard dim) of a full tensor of this parameter's (tp-local) shape."""
        return full.narrow(self.shard_dim, self.row_start, self.num_valid_rows)

    def tp_local(self, full: torch.Tensor) -> torch.Tensor:
        """This tp rank's piece of a global tensor of this parameter's shape (the tensor itself
        without tensor parallelism): DTensor's chunking, as `distribute_tensor` cuts it."""
        return full if self.tp is None else self.tp.local_piece(full)

    def install(self, sharded: bool) -> None:
        """Register the sharded or the unsharded parameter on every owner module."""
        param = self.followed_param if sharded else self.unsharded_param
        for module, name in self.owners:
            module._parameters[name] = param
        self._installed = True

    def scatter_from(self, full: torch.Tensor | None, src: int) -> None:
        """Overwrite the shard with this rank's rows of `full`, which only global rank `src` has."""
        world = self.mesh_info.shard_size
        local = self.local_shard
        group = self.mesh_info.shard_group
        if self.tp is not None or dist.get_world_size(group) != dist.get_world_size():
            # The shard group is not every rank (HSDP, a dp axis beside tp or pp), so the source is
            # not in every rank's shard group: every rank receives the whole parameter. The test
            # must read the same on every rank, or some would scatter while others broadcast.
            whole = full.to(self.device, self.orig_dtype) if dist.get_rank() == src else torch.empty(
                self.orig_size, dtype=self.orig_dtype, device=self.device
            )
            dist.broadcast(whole, src=src)
            local.copy_(self.own_rows(self.tp_local(whole)))
            return
        rows = torch.empty((self.padded_dim0, *self.moved_size[1:]), dtype=self.orig_dtype, device=self.device)
        chunks = None
        if dist.get_rank() == src:
            padded = full.new_zeros((world * self.padded_dim0, *self.moved_size[1:]), dtype=self.orig_dtype, device=self.device)
            padded[: self.moved_size[0]].copy_(full.movedim(self.shard_dim, 0))
            chunks = list(padded.chunk(world))
        dist.scatter(rows, chunks, src=src, group=group)
        local.copy_(rows[: self.num_valid_rows].movedim(0, self.shard_dim))

    # -- unsharded side ------------------------------------------------------------------------

    def alloc_unsharded(self, world: int) -> torch.Tensor:
        """Allocate (or re-allocate) the unsharded storage; returns the padded rows the all-gather
        output is copied into, viewed as (world, shard_numel). For a shard dim k > 0 they are a
        staging buffer that `finish_copy_out` moves into the parameter ([Note: Sharding on another dim])."""
        if self._unsharded_padded is None:
            padded = torch.empty(
                (world * self.padded_dim0, *self.moved_size[1:]),
                dtype=self.unsharded_dtype,
                device=self.device,
            )
            self._unsharded_padded = padded
            if self.shard_dim == 0:
                unsharded = padded[: self.local_size[0]]
            else:
                unsharded = torch.empty(self.local_size, dtype=self.unsharded_dtype, device=self.device)
            self._unsharded_local = unsharded
            self.unsharded_param = nn.Parameter(self._wrap_tp(unsharded), self.requires_grad)
        else:
            refill(self._unsharded_padded)
            if self.shard_dim != 0:
                refill(self._unsharded_local)
        return self._unsharded_padded.view(world, self.shard_numel)

    def _wrap_tp(self, local: torch.Tensor) -> torch.Tensor:
        """`local` as the module computes with it: itself, or a tp DTensor sharing its storage."""
        if self.tp is None:
            return local
        with torch.no_grad():  # a leaf: the parameter, not a function of `local`
            return self.tp_dtensor(local)

    def tp_dtensor(self, local: torch.Tensor) -> DTensor:
        """The tp-local unsharded tensor `local` as the tp DTensor `parallelize_module` made. Its
        backward hands `local` the gradient on the tp placements (e.g. Partial summed to Replicate)."""
        return self.tp.dtensor(local, self.orig_size)

    def unsharded_tensors(self) -> tuple[torch.Tensor, ...]:
        """The unsharded parameter and, for a tp DTensor, its local tensor (whose versions copy-out keeps)."""
        if self.tp is None:
            return (self.unsharded_param,)
        return (self.unsharded_param, self._unsharded_local)

    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the unsharded parameter as the local tensor the reduce-scatter packs."""
        return self.tp.local_grad(grad) if isinstance(grad, DTensor) else grad

    def finish_copy_out(self) -> None:
        """Shard dim k > 0: move the gathered rows into the parameter's layout, free the staging."""
        if self.shard_dim != 0:
            rows = self._unsharded_padded[: self.moved_size[0]]
            self._unsharded_local.copy_(rows.movedim(0, self.shard_dim))
            self._unsharded_padded.untyped_storage().resize_(0)

    def gathered_rows(self, world: int) -> torch.Tensor:
        """The unsharded parameter as the all-gather output holds it, (world, shard_numel)."""
        rows = self.alloc_unsharded(world)
        if self.shard_dim != 0:
            self._unsharded_padded[self.moved_size[0] :].zero_()
            self._unsharded_padded[: self.moved_size[0]].copy_(self._unsharded_local.movedim(self.shard_dim, 0))
        return rows

    def free_unsharded(self) -> None:
        """Drop the unsharded storage; the parameter object (and any gradient on it) stays."""
        if self._unsharded_padded is not None:
            self._unsharded_padded.untyped_storage().resize_(0)
            self._unsharded_local.untyped_storage().resize_(0)
        for t in (*self._gather_outputs, *self._to_free):
            t.untyped_storage().resize_(0)

    def accumulate_unreduced_grad(self, reduce_dtype: torch.dtype | None) -> None:
        """After a backward without sync: keep the unsharded gradient for a later reduction, in
        `reduce_dtype` as FSDP2 does (so bf16 micro-batch gradients add up in fp32)."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is None:
            return
        if self.unreduced_grad is not None:
            self.unreduced_grad += self._local_grad(grad)
            self.unsharded_param.grad = None
        elif self.tp is not None or (reduce_dtype is not None and grad.dtype != reduce_dtype):
            # `.grad` must have the parameter's dtype (and type), so the kept copy lives here instead.
            self.unreduced_grad = self._local_grad(grad).to(reduce_dtype or grad.dtype)
            self.unsharded_param.grad = None

    @property
    def has_unsharded_grad(self) -> bool:
        """Whether a backward left a gradient on the unsharded parameter."""
        return self.unsharded_param is not None and self.unsharded_param.grad is not None

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient (None if there is none), which the parameter then gives up."""
        grad = None
        if self.unsharded_param is not None:
            grad, self.unsharded_param.grad = self.unsharded_param.grad, None
            if grad is not None:
                grad = self._local_grad(grad)
        if self.unreduced_grad is not None:
            accumulated, self.unreduced_grad = self.unreduced_grad, None
            if grad is not None:
                accumulated += grad
            grad = accumulated
        return grad

    def accumulate_sharded_grad(self, flat_shard: torch.Tensor) -> None:
        """Set or add this rank's reduced gradient (padded, flat) to the sharded parameter, then
        run the parameter's post-accumulate-grad hooks.

        [Note: The sharded gradient is the parameter's own]
        As in FSDP2, a gradient that exists is added to in place, so `.grad` stays the tensor an
        optimizer or a user holds across accumulated backwards and `zero_grad(set_to_none=False)`;
        and hooks registered with `register_post_accumulate_grad_hook` on the sharded parameter run
        once its reduced gradient is there (autograd never reaches that parameter in eager mode, so
        it cannot run them itself). Optimizer-in-backward relies on both.
        """
        local = flat_shard[: self.num_valid_rows * self.row_numel].view(
            self.num_valid_rows, *self.moved_size[1:]
        )
        local = local.movedim(0, self.shard_dim).to(self.orig_dtype)
        grad = self.sharded_param.grad
        if grad is None and self.pinned and local.device != self.shard_device:
            host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            host.copy_(local, non_blocking=True)  # as FSDP2 does with pinned memory
            self.host_copy_pending = True
            self.sharded_param.grad = self._to_dtensor(host)
        else:
            local = local.to(self.shard_device).contiguous()
            if grad is None:
                self.sharded_param.grad = self._to_dtensor(local)
            else:
                self.wait_host_copy()
                if isinstance(grad, DTensor) and grad._local_tensor.shape == local.shape:
                    grad._local_tensor.add_(local)
                else:  # a `.grad` the user replaced by something else
                    self.sharded_param.grad = self._to_dtensor(grad.to_local() + local)
        self._run_post_accumulate_grad_hooks()

    def _run_post_accumulate_grad_hooks(self) -> None:
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None)
        if not hooks:
            return
        self.wait_host_copy()  # a hook reads `.grad` now
        for hook in tuple(hooks.values()):
            hook(self.sharded_param)

    def wait_host_copy(self) -> None:
        """Wait for a non-blocking device-to-host gradient copy still in flight, if any."""
        if self.host_copy_pending:
            torch.cuda.current_stream(self.device).synchronize()
            self.host_copy_pending = False


def shard_dim_first(t: torch.Tensor, shard_dim: int) -> torch.Tensor:
    """`t`, in a parameter's layout, with dim `shard_dim` moved first: the layout the collectives
    move ([Note: Sharding on another dim])."""
    return t if shard_dim == 0 else t.movedim(shard_dim, 0)


@functools.lru_cache(maxsize=None)
def _watch_parameter_registrations() -> None:
    nn.modules.module.register_module_parameter_registration_hook(_note_parameter_registered)


def _note_parameter_registered(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Every `module.<name> = nn.Parameter(...)` (and `load_state_dict(assign=True)`, which assigns):
    where it replaces one of our sharded parameters, tell its `ShardedParam`. A compiled step reads
    the count its root keeps, so the replacement recompiles it ([Note: The sharded parameter is the
    one its module holds]); `install` writes `_parameters` directly and is not counted."""
    old = module._parameters.get(name)
    owner = getattr(old, OWNER_ATTR, None) if old is not None and old is not param else None
    if owner is not None:
        owner.on_replaced()


def hook_even_if_frozen(param: torch.Tensor, register) -> None:
    """`register(param)` a gradient hook whatever `param.requires_grad` is now. Torch refuses hooks
    on a tensor without requires_grad, but keeps them through later `requires_grad_` calls, so a
    parameter frozen now is hooked for when it is unfrozen. A parameter that cannot require
    gradients (integer dtypes) never needs the hook. See [Note: Parameters changed after fully_shard]."""
    if param.requires_grad:
        register(param)
    elif param.is_floating_point() or param.is_complex():
        with torch.no_grad():  # flipping a leaf's flag, not an op autograd should record
            param.requires_grad_(True)
            try:
                register(param)
            finally:
                param.requires_grad_(False)
