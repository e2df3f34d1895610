"""The unshard and reshard a group does while Dynamo traces its module: collectives as graph nodes.

While Dynamo traces, the traced state's forward hooks (traced/hooks.py) call `unshard` and `install`. Nothing here touches
the eager runtime's buffers or states: the group stays `ShardedState.SHARDED` the whole step, the
sharded DTensor parameters are the graph's inputs, and autograd writes their `.grad` directly.

[Note: Traced unshard]
Pre-forward builds the bucket the group's `BucketLayout` describes, with the registered ops the
eager runtime calls too ([Note: One bucket layout for eager and traced steps] in
runtime/bucket_layout.py):

    flat   = fsdp_graph::copy_in(p.to_local().flatten() for p in group.params)  # zero-padded
    full   = wait(all_gather_into_tensor(flat))            # (world * sum shard_numel,)
    params = fsdp_graph::copy_out(full, ...)               # one op for the whole group, where each
    param  = full.view(world, -1)[:, offset:offset + shard_numel].reshape(world * padded_dim0, ...)[:dim0]

Where the group's shards are views of its persistent shard buffer, `flat` is that buffer, a graph
input, and no copy-in is traced ([Note: Traced gathers read the shard buffer]). Dynamo sees all of
this as one op, `fsdp_graph::gather_group`, and AOTAutograd traces what it calls ([Note: A group's
gather is one op to Dynamo] in traced/ops.py).
`copy_in`, `copy_out` and its gradient, `pack_grads` (each parameter's gradient into its columns of
the reduce-scatter input, zeros in the padding), are custom ops, so Inductor runs each as one ATen
call. Written as slices and cats, every parameter's copy became a kernel of its own (or was fused
into a neighbour) with the parameter's offset baked in, so each parameter of a block needed a
different kernel: on CPU each is a C++ compile. A group of one parameter needs no copy-out: its
rows are the padded parameter, so it stays a view.
Pre-forward installs each unsharded tensor by shadowing: `owner.__dict__[name] = param`. `nn.Module`
keeps parameters in `_parameters` and `__getattr__` is only a fallback, so the instance dict wins
and the module's forward reads the gathered tensor, while `named_parameters()`, the optimizer and
`state_dict()` still see the DTensor. Post-forward deletes the shadows again.

Difference from eager, by design: an int `reshard_after_forward` re-gathers from the full shard
group (same numbers). A parameter the forward does not use keeps `.grad` None as in eager mode: see
[Note: Gradient flags in a graph].

The all-gather and its gradient are one autograd.Function (`AllGatherShards`) whose backward does
what `collectives.reduce_scatter` does, in the same order: cast to the reduce dtype, reduce-scatter
with SUM, all-reduce over the replicate axis (HSDP), divide, cast back. So fp32 gradients match the
eager runtime bit for bit.

Every node made here runs under `torch.fx.traceback.annotate` with the group's name and whether it
reshards after forward (see passes/nodes.py); `passes/reshard.py` uses that to make the backward
gather again instead of saving the unsharded parameters.
"""


from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.fx.traceback import annotate

from ..runtime.bucket_layout import BucketLayout
from ..runtime.collectives import divide_factors
from ..runtime.meta import GROUP_KEY, RESHARD_KEY, ROLE_KEY, ROLE_UNSHARD
from ..runtime.multi_mesh_group import MultiMeshGroup
from ..runtime.param_group import ParamGroup
from .ops import C10D, GradientBucket, route_gradients, to_param_layout

logger = logging.getLogger(__name__)

# [Note: Gradient flags in a graph]
# A compiled backward produces a gradient for every sharded parameter: zeros where the forward did
# not use it (the bucket must hold every parameter, [Note: Every rank packs every parameter]). Eager
# PyTorch leaves such a `.grad` None, and AdamW skips None but decays and advances zeros. So the
# traced bucket carries, like the eager one, one flag per trainable parameter after the gradients:
# the flags ride in the columns of `group.grad_flags`, a small leaf gathered (as zeros) with the
# shards, and its gradient, after the reduce-scatter, is the sum over ranks of "had a gradient".
# Once the backward ends, a parameter whose flag is 0 on every rank and whose `.grad` this backward
# created (a hook saw it None just before) gets None back. Only then are the flags read (a device
# sync on CUDA), and only where some parameter may have had no gradient on this rank: [Note: Flags
# that need no reading].
# A backward that writes no parameter gradient (`torch.autograd.grad(loss, inputs=[x])`) still runs
# the graph's reduce-scatters: the compiled backward is one autograd node that computes all its
# outputs, and only the accumulators after it are skipped, so `.grad` (and the flags) stay as they
# were. The eager runtime skips them: [Note: A backward that writes no parameter gradient].


# [Note: Flags that need no reading]
# Reading the flags makes the host wait for the device to finish the backward before the optimizer
# can launch anything (docs/benchmarks.md, One H200). A step needs them only where
# a trainable parameter had no gradient on this rank: where every rank gave each one a gradient, no
# `.grad` goes back to None. Which parameters the forward used is fixed when the step is traced, so
# `AllGatherRow`'s backward (traced/ops.py) knows it, from the gradients autograd hands it
# (None for an unused output), and returns no gradient for the flags where every trainable one was
# used. Then autograd accumulates nothing into the flags leaf and `.grad` is None there, which the
# host sees without a sync. The numbers come from the row's gradient instead (`row_flags`, its flags'
# columns, summed over every call of the group in the step): a module called twice, once with every
# parameter and once without, gives flags to the leaf from the second call only, yet no parameter of
# it may lose its gradient. The end-of-backward work is queued by the shard buffer's hand-out (and
# by the flags, for a group without a row), so it runs whether or not the flags got a gradient.
# Groups without a row still return the flags every step, so their steps read them: the copy-in
# path (`AllGatherShards`: a shard not on dim 0, no buffer) and byte buckets (`RouteGradients`).


def finish_at_backward_end(group: ParamGroup) -> None:
    """Queue `_restore_none_grads` for the end of the running backward."""
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _restore_none_grads(group))


def track_gradient_flags(group: ParamGroup) -> None:
    """Give `group` its flags leaf and the hooks that restore None gradients after compiled steps.

    Every parameter is watched and has a flag slot, frozen ones too, since `requires_grad_` may
    change between steps: [Note: Parameters changed after fully_shard] in runtime/param.py.
    """
    for p in group.params:
        p.watch_grad_before_backward()
    new_flags_leaf(group)


def new_flags_leaf(group: ParamGroup) -> None:
    """(Re)make `group.grad_flags`, one slot per parameter of the group, where the shards are now:
    `shard_device`, meta for a model that was never materialised, and again after `to_empty()` or
    `.to()` moved them. A traced step gathers the slots of the parameters trainable then."""
    group.grad_flags = torch.zeros(len(group.params), device=group.params[0].local_shard.device, requires_grad=True)

    group.grad_flags.register_post_accumulate_grad_hook(lambda _flags: finish_at_backward_end(group))


def _trainable_flags(leaf: torch.Tensor, trainable: tuple[int, ...]) -> torch.Tensor:
    """The slots of the parameters `trainable` (indices into `group.params`) in the flags `leaf`,
    as one tensor whose gradient lands in those slots."""
    return leaf if len(trainable) == leaf.numel() else leaf[list(trainable)]


def _restore_none_grads(group: ParamGroup) -> None:
    """The end of a compiled backward for `group`; may run twice in one (queued by the row's
    hand-out and by the flags), the second time with nothing left to do."""
    flags, group.grad_flags.grad = group.grad_flags.grad, None
    row_flags = group.shard_buffer.take_row_flags() if group.shard_buffer is not None else None
    seen = [p.requires_grad and p.grad_seen for p in group.params]
    for p in group.params:
        p.grad_seen = False
    if flags is None and not any(seen):
        # The group ran in the graph but no gradient reached it (its outputs were detached): the
        # accumulators got nothing and `.grad` is as it was. FSDP2 reduces such a group as zeros
        # when asked to: [Note: Every rank packs every parameter].
        if group.reduce_controls.zeros_for_unused:
            for p in group.params:
                if p.requires_grad and p.sharded_param.grad is None:
                    p.accumulate_sharded_grad(p.local_shard.new_zeros(p.shard_numel))
    elif flags is not None and not flags.is_meta and not group.reduce_controls.zeros_for_unused:
        # No flags: every trainable parameter had a gradient here ([Note: Flags that need no
        # reading]). meta: a model traced for its graphs only; zeros_for_unused: FSDP2 keeps the zeros.
        # Only a gradient this backward created (its watch saw `.grad` None) is ever taken back:
        # a parameter whose watch was lost keeps what it has ([Note: The sharded parameter is the
        # one its module holds] in runtime/param.py).
        created = [was_seen and p.grad_was_none for p, was_seen in zip(group.params, seen)]
        if any(created):  # read the flags (a device sync) only when a gradient may go
            for p, flag, new in zip(group.params, _flag_per_param(group, flags, row_flags), created):
                if new and flag <= 0:
                    p.sharded_param.grad = None
    group.follow_registered_params()  # for the next step, should anything have replaced a shard


def _flag_per_param(group: ParamGroup, flags: torch.Tensor, row_flags: Optional[torch.Tensor]) -> list[float]:
    """Per parameter of `group`, how many ranks gave it a gradient: from the row's gradient where
    the group had one, in `layout.reduced` order, else from the flags leaf's (a slot per parameter)."""
    if row_flags is None:
        return flags.tolist()
    per_param = [0.0] * len(group.params)
    for index, flag in zip(group.layout.reduced, row_flags.tolist()):
        per_param[index] = flag
    return per_param


def _reshards_after_forward(group: ParamGroup) -> bool:
    # An int `reshard_after_forward` reshards to a smaller group in eager; in a graph the backward
    # gathers from the full shard group instead, which gives the same numbers.
    return group.reshard_after_forward is not False


def unshard(group: ParamGroup) -> list[torch.Tensor]:
    """Trace the all-gather of `group`; returns one unsharded tensor per `group.params` entry, as
    the module computes with it. See [Note: Traced tensor-parallel parameters]."""
    if isinstance(group, MultiMeshGroup):  # [Note: A group on several meshes]: each mesh's in turn
        return [t for g in group.groups for t in unshard(g)]
    layout = group.layout  # refreshed before this trace began: see [Note: Tracing reads what was followed]
    unsharded = (_unshard_bytes if layout.as_bytes else _unshard_plain)(group, layout)
    if not group.has_tp:
        return unsharded
    return [t if p.tp is None else p.tp_dtensor(t) for p, t in zip(group.params, unsharded)]


# [Note: Traced tensor-parallel parameters]
# A parameter that tensor parallelism made a DTensor is gathered as its tp-local tensor, as in the
# eager runtime ([Note: Sharding a tensor-parallel parameter] in runtime/tp_layout.py), and handed
# to the module as `DTensor.from_local` over the tp mesh with the tp placements. Dynamo traces that,
# and the module's DTensor ops, into tensor parallelism's own functional collectives (the
# rowwise all-reduce, sequence parallelism's all-gathers and reduce-scatters); `from_local`'s
# backward moves the gradient to the tp placements (a Partial gradient is all-reduced over tp)
# before it reaches the FSDP reduce-scatter. The wrap runs outside the group's annotation, so only
# FSDP's own collectives carry GROUP_KEY: the passes move those and treat every other collective
# as fixed (passes/nodes.py, `is_fsdp_collective`).


def _unshard_plain(group: ParamGroup, layout: BucketLayout) -> list[torch.Tensor]:
    """`unshard` for a group without all-gather extensions: tp-local tensors, from one
    `fsdp_graph::gather_group` ([Note: A group's gather is one op to Dynamo] in traced/ops.py).

    The row in the group's layout ([Note: One bucket layout for eager and traced steps]): the
    trainable parameters and the flags ([Note: Gradient flags in a graph]) are the blocks the
    backward reduces, the eager runtime's reduce-scatter row, so gradients match it bit for bit;
    the frozen parameters follow. While Dynamo traces, a parameter's shard is the one last
    followed: read without the `sharded_param` property, whose check Dynamo would step for every
    parameter of every layer.
    """
    mesh_info = group.mesh_info
    reduce_dtype = group.mp_policy.reduce_dtype
    annotation = {GROUP_KEY: group.name, RESHARD_KEY: _reshards_after_forward(group), ROLE_KEY: ROLE_UNSHARD}
    row = _shard_buffer_row(group, layout)
    if row is not None:
        # The parameters are no graph inputs, yet a parameter frozen, unfrozen or converted
        # (`requires_grad_`, `model.to(dtype)`) must recompile the step, whose layout it changes:
        # reading them here leaves Dynamo's guards on them (the reads themselves leave the graph).
        _ = [p.followed_param.requires_grad for p in group.params]
    with annotate(annotation):  # [Note: Traced gathers read the shard buffer]: the row, or None to copy in
        return torch.ops.fsdp_graph.gather_group(
            [p.followed_param for p in group.params] if row is None else [],
            group.grad_flags if layout.reduced else None,
            row,
            layout.world,
            layout.blocks,
            layout.widths,
            layout.numels,
            layout.reduce_offsets,
            layout.shard_dims,
            layout.moved_sizes,
            layout.dtype,
            mesh_info.shard_group_name,
            _reduce_group_name(group),
            _replicate_group_name(mesh_info),
            divide_factors(
                group.gradient_divide_factor or float(layout.world * mesh_info.replicate_size),
                reduce_dtype or layout.dtype,
            ),
            reduce_dtype,
        )


# [Note: Traced all-gather extensions]
# A group with a parameter whose shard class defines fsdp_pre_all_gather / fsdp_post_all_gather
# ([Note: All-gather extensions] in runtime/all_gather_extensions.py) traces what the eager
# runtime does with it:
#
#   inputs, meta = type(shard).fsdp_pre_all_gather(shard, mesh, ...)   # e.g. fp8 data, 1 byte each
#   bucket       = cat(input.view(uint8) for every input, padded_shard.view(uint8) for the others)
#   gathered     = wait(all_gather_into_tensor(bucket))               # uint8, one per group
#   pieces       = fsdp_graph::copy_out(gathered, ...)                # each input's (world * rows)
#   unsharded    = type(shard).fsdp_post_all_gather(shard, pieces, meta, dtype)[0][:dim0]
#   params       = RouteGradients(bucket, flags, *flat_shards, *unsharded)  # identity forward
#
# The hooks are found and called as the eager runtime does ([Note: Extensions found on the tensor
# instance] in runtime/all_gather_extensions.py): a class's through the class, which Dynamo inlines
# (a method call on a tensor subclass is an op it tries to put in the graph, and gives up), one set on the tensor
# instance as stored, which Dynamo also inlines, guarding on the attribute. Both hooks run under no_grad, as in
# FSDP2 and the eager runtime: the bytes and their casts carry no gradient (an fp8 cast has none
# worth having). The gradient of the rebuilt parameter is the unsharded gradient, reduce-scattered
# to the shard as for any parameter: `RouteGradients` hands the rebuilt tensors through
# unchanged, and its backward packs their gradients into the eager runtime's reduce-scatter bucket
# (trainable parameters in group order, then the flags of [Note: Gradient flags in a graph]),
# reduce-scatters and divides as `AllGatherShards`, and gives each shard its rows. The shard's
# gradient is a plain tensor, as in FSDP2, also where the shard is a subclass. Dynamo does not trace
# the Function (`route_gradients` is `nonstrict_trace`: an opaque call that AOTAutograd traces):
# Dynamo's own rendering of an autograd.Function hands its backward zeros for outputs nobody used,
# whatever `set_materialize_grads` says, and the flags would then give an unused parameter a zero
# gradient where eager mode leaves None. The post-hook's `out=`
# form refills a saved parameter in place; a graph has no such storage to refill, so only the
# first-time form is traced. Every node runs under the group's annotation, so for a group that
# reshards after forward, passes/reshard.py makes the backward run the pre-hook, the all-gather and
# the post-hook again, as the eager runtime does.


def _unshard_bytes(group: ParamGroup, layout: BucketLayout) -> list[torch.Tensor]:
    """`unshard` for a group gathered as bytes (all-gather extensions, or parameters of several
    dtypes): one uint8 all-gather of what the pre-hooks return and the other shards, the post-hooks,
    and the gradients routed to the shards. See [Note: Traced all-gather extensions] and
    [Note: Byte buckets] in runtime/bucket_layout.py (the eager runtime gathers the same bytes)."""
    world = layout.world
    mesh_info = group.mesh_info
    annotation = {GROUP_KEY: group.name, RESHARD_KEY: _reshards_after_forward(group), ROLE_KEY: ROLE_UNSHARD}
    with annotate(annotation), torch.no_grad():
        hook_layouts = {}  # per parameter with extensions: (metadata, [(dtype, gathered shape)] per input)

        def pre_all_gather(i: int) -> list[torch.Tensor]:
            p = group.params[i]
            inputs, metadata = p.call_pre_all_gather(p.local_shard)
            hook_layouts[i] = (metadata, [(t.dtype, (world * t.shape[0], *t.shape[1:])) for t in inputs])
            return inputs

        pieces, widths = layout.byte_pieces(group.params, pre_all_gather)
        gathered = torch.ops.fsdp_graph.copy_in(pieces, widths)
        if world > 1:  # [Note: One rank issues no collectives] in runtime/collectives.py
            gathered = C10D.wait_tensor(C10D.all_gather_into_tensor(gathered, world, mesh_info.shard_group_name))
        outputs = iter(torch.ops.fsdp_graph.copy_out(gathered, world, widths, [world * w for w in widths], -1))
        rebuilt = []  # shard dim first, as the collectives move them
        for i, p in enumerate(group.params):
            if not layout.has_hooks(i):
                rebuilt.append(next(outputs).view(p.unsharded_dtype)[: p.local_size.numel()].view(p.moved_size))
                continue
            metadata, input_layouts = hook_layouts[i]
            gathered_inputs = tuple(next(outputs).view(t_dtype).view(size) for t_dtype, size in input_layouts)
            rebuilt.append(p.call_post_all_gather(p.local_shard, gathered_inputs, metadata)[0])
    if layout.reduced:
        params = [group.params[i] for i in layout.reduced]
        reduce_dtype = group.mp_policy.reduce_dtype or params[0].unsharded_dtype
        bucket = GradientBucket(
            world,
            layout.reduce_widths,
            layout.reduce_numels,
            tuple(p.num_valid_rows * p.row_numel for p in params),
            tuple(p.orig_dtype for p in params),
            reduce_dtype,
            gathered.device,
            _reduce_group_name(group),
            _replicate_group_name(mesh_info) or "",
            divide_factors(group.gradient_divide_factor or float(world * mesh_info.replicate_size), reduce_dtype),
        )
        with annotate(annotation):
            routed = route_gradients(
                bucket,
                _trainable_flags(group.grad_flags, layout.reduced).to(reduce_dtype),
                *[p.flat_local_shard() for p in params],
                *[rebuilt[i] for i in layout.reduced],
            )
        for i, tensor in zip(layout.reduced, routed):
            rebuilt[i] = tensor
    return [to_param_layout(tensor, p.shard_dim) for p, tensor in zip(group.params, rebuilt)]


# [Note: Traced gathers read the shard buffer]
# Where every parameter of a group is a view of its shard buffer ([Note: Sharded parameters live in
# their group's row] in runtime/shard_buffer.py), the traced gather takes the buffer itself as the
# all-gather's input and copies nothing in:
#
#     gathered = AllGatherRow(row, ..., flags)   # all_gather_into_tensor(row), wait
#
# With trainable parameters, `row` is the buffer's gradient leaf, and the reduced row is its
# gradient: the sharded parameters are no graph inputs at all ([Note: Compiled gradients arrive as
# the row's] in runtime/shard_buffer.py). The graph cannot
# check at run time that the shards still are views of the buffer. It need not: every trace begins
# by following the parameters ([Note: Tracing reads what was followed] in traced/callbacks.py), which
# puts each replaced or swapped shard back into the buffer and views it again, and the trace reads
# the buffer's `all_viewed` as that left it (Dynamo guards the flag). A parameter assigned between
# compiled steps recompiles the step (`parameters_replaced`), which follows it first; `swap_tensors`
# refuses a compiled step's parameters. A group with a shard that is not a view (sharded on
# dim k > 0) or without a buffer traces the copy-in. Ranks may trace one and run the other: the
# row is the same bytes either way.


def _shard_buffer_row(group: ParamGroup, layout: BucketLayout) -> Optional[torch.Tensor]:
    """The group's shard buffer (its gradient leaf, with trainable parameters), if every parameter
    is a view of it in `layout`; else None."""
    shard_buffer = group.shard_buffer
    if shard_buffer is None or shard_buffer.layout is not layout:
        return None
    return shard_buffer.row_for_trace()


def _replicate_group_name(mesh_info) -> Optional[str]:
    """The group of the HSDP all-reduce; None without one, or with one replica (nothing to reduce)."""
    return mesh_info.replicate_group_name if mesh_info.replicate_size > 1 else None


def _reduce_group_name(group: ParamGroup) -> str:
    """The group the gradients are reduce-scattered on: the shard group, or its own copy."""
    separate = group.reduce_controls.reduce_scatter_group
    return group.mesh_info.shard_group_name if separate is None else separate.group_name


def install(group: ParamGroup, unsharded: Optional[list[torch.Tensor]]) -> None:
    """Shadow (or un-shadow, with None) every owner's parameter attribute. See [Note: Traced unshard]."""
    # One flat loop over the group's owner slots: Dynamo traces every loop step in every layer.
    if unsharded is None:
        for module, name, _ in group.owner_slots:
            del module.__dict__[name]
    else:
        for module, name, i in group.owner_slots:
            module.__dict__[name] = unsharded[i]
