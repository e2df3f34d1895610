"""A group's persistent shard buffer: this rank's row of the group's all-gather, laid out by its
`BucketLayout`, held for the group's life; the sharded parameters are views of it.

[Note: Sharded parameters live in their group's row]
A gather needs this rank's row of the bucket ([Note: One bucket layout for eager and traced steps]
in runtime/bucket_layout.py): every parameter's padded shard, the gradient flags' zeros, in the
layout's order. Copying each shard into a fresh row at every gather (copy-in) moves bytes that
could stay where they are. So each group that can keeps one flat buffer, `ShardBuffer.flat`, which
*is* that row, and the local tensor of each sharded DTensor parameter is a view of its valid rows
in it, as FSDP2 keeps each padded shard in one tensor and the local tensor a view of it
(`FSDPParam.reset_sharded_param`), only one buffer per group instead of per parameter. The optimizer,
`load_state_dict` (without `assign`), DCP and initialisation write the shards in place, so the
row is current whenever a gather begins; the padding and the flags' columns stay zeros. The eager
all-gather reads `flat` as its input (runtime/collectives.py); a traced one takes it as a graph
input ([Note: Traced gathers read the shard buffer] in traced/unshard.py).

What lives here and what views what:
- `flat`: (sum of the layout's widths,) in the shards' dtype, on their device (CPU when offloaded,
  pinned with `CPUOffloadPolicy(pin_memory=True)`).
- A parameter sharded on dim 0: its local tensor is `flat[offset : offset + valid]` viewed in the
  shard's shape.
- A parameter sharded on dim k > 0: its local tensor keeps its own storage (its slot holds the
  shard with dim k moved first, [Note: Sharding on another dim] in runtime/param.py, a layout no
  view of the shard has), and the eager gather copies it into its slot first.

Parameters replaced or swapped after `fully_shard` ([Note: The sharded parameter is the one its
module holds] in runtime/param.py) lose the view: where the runtime follows them (`follow`), the new
shard's values are copied into its slot and its local tensor becomes the view again, as FSDP2's
lazy init re-pads a replaced shard. A shard whose dtype or device changed (`model.to(torch.float64)`,
`to_empty()`), or a layout rebuilt (a parameter frozen or unfrozen), rebuilds the buffer.

Groups without a buffer keep the copy-in: a byte bucket ([Note: Byte buckets]: mixed unsharded
dtypes, all-gather extensions), shards of several dtypes or devices, and shards whose local tensor
is a tensor subclass. `ShardBuffer.reason_not` says which.

[Note: Compiled gradients arrive as the row's]
A compiled step reads the row, not the parameters ([Note: Traced gathers read the shard buffer] in
traced/unshard.py). Had it taken each sharded DTensor parameter as a graph input for its gradient,
Dynamo would wrap and guard every parameter of every layer (the DTensor, its local tensor, mesh and
base) and AOTAutograd would trace each one's `to_local()` and its gradient's slices and views: at
16 HF Llama layers that was most of what a layer added to the compile (docs/benchmarks.md). So the
graph's only input for a group's gradients is `grad_leaf`, a leaf that aliases `flat` (the same
storage, no autograd history): the all-gather reads it, and its gradient is the reduced row, in the
row's layout, as the eager reduce-scatter leaves it. Once autograd has accumulated that gradient,
`_hand_out_row_grad` gives each trainable parameter its slot, as the eager runtime does with its
reduce-scatter output (`ShardedParam.accumulate_sharded_grad`: a view where `.grad` was None, an
in-place add where it was not, then the parameter's post-accumulate-grad hooks), and drops the
leaf's own `.grad`, so each backward starts from nothing. It records, as the parameters' own
gradient watches do in eager steps, which `.grad` was None ([Note: Gradient flags in a graph] in
traced/unshard.py). The leaf carries the first parameter's owner tag, by which the compile backend
finds the group's root. A backward that reaches no accumulator (`torch.autograd.grad`) leaves the
leaf, and so every `.grad`, as it was.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from .bucket_layout import FLAGS, BucketLayout
from .param import OWNER_ATTR, ShardedParam


class ShardBuffer:
    """This rank's all-gather row of one group, which its dim-0 shards are views of.

    See [Note: Sharded parameters live in their group's row].

    Attributes:
        layout: the layout the row is laid out in.
        flat: the row.
        offsets: per block of the layout, its first element in `flat`.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: list[ShardedParam],
        pin_memory: bool = False,
        on_hand_out: Optional[Callable[[], None]] = None,
    ) -> None:
        local = params[0].sharded_param._local_tensor
        self.layout = layout
        # Padding and the flags' columns are zeros on the wire: they stay zeros here.
        # Pinned only where it is host memory: a meta buffer (deferred init) is pinned when
        # `to_empty()` rebuilds it on the CPU.
        pin_memory = pin_memory and local.device.type == "cpu"
        self.flat = torch.zeros(sum(layout.widths), dtype=local.dtype, device=local.device, pin_memory=pin_memory)
        self.offsets = tuple(itertools.accumulate(layout.widths, initial=0))[:-1]
        # Per parameter: the view of `flat` its local tensor was made (None: not one).
        self._views: list[Optional[torch.Tensor]] = [None] * len(params)
        # Whether every parameter's local tensor is its view, as of the last `follow`: then the
        # row is current without copying any shard in. See `row_for_trace`.
        self.all_viewed = False
        self.follow(params)
        # The row as a leaf of its own for compiled steps: see [Note: Compiled gradients arrive as the row's].
        self._params = params
        self.grad_leaf = self.flat.detach().requires_grad_()
        setattr(self.grad_leaf, OWNER_ATTR, params[0])  # the compile backend finds the group's root by it
        self.grad_leaf.register_post_accumulate_grad_hook(self._hand_out_row_grad)
        # Called after each hand-out (the group's end-of-backward work), and the flags' columns of
        # the last row gradient handed out, until taken: [Note: Flags that need no reading] in
        # traced/unshard.py.
        self.on_hand_out = on_hand_out
        self.row_flags: Optional[torch.Tensor] = None

    def _hand_out_row_grad(self, leaf: torch.Tensor) -> None:
        """After a compiled backward: each trainable parameter's slot of the row's gradient
        accumulated into the parameter as the eager runtime's reduce-scatter output is."""
        row_grad, leaf.grad = leaf.grad, None
        if row_grad is None or row_grad.is_meta:  # no gradient reached the row; a trace on meta has no numbers
            return
        for index in self.layout.reduced:
            p = self._params[index]
            p.note_grad_arriving(p.sharded_param)
            p.accumulate_sharded_grad(self._slot(index, row_grad))
        if self.layout.flags_at >= 0:  # a copy: a slice would keep the whole row alive
            start = self.layout.reduce_offsets[-2]
            self.row_flags = row_grad[start : start + self.layout.num_trainable].clone()
        if self.on_hand_out is not None:
            self.on_hand_out()

    def take_row_flags(self) -> Optional[torch.Tensor]:
        """The flags' columns of the row gradient handed out last (one per trainable parameter, in
        `layout.reduced` order: how many ranks gave it a gradient), once; None if none since."""
        row_flags, self.row_flags = self.row_flags, None
        return row_flags

    @staticmethod
    def reason_not(layout: BucketLayout, params: list[ShardedParam]) -> Optional[str]:
        """Why the parameters cannot live in one buffer laid out by `layout`; None if they can."""
        if layout.as_bytes:
            return "the group gathers a byte bucket (mixed unsharded dtypes or all-gather extensions)"
        locals_ = [p.sharded_param._local_tensor for p in params]
        if len({t.dtype for t in locals_}) > 1:
            return "the shards have several dtypes"
        if len({t.device for t in locals_}) > 1:
            return "the shards are on several devices"
        if any(type(t) is not torch.Tensor for t in locals_):
            return "a shard's local tensor is a tensor subclass"
        return None

    def fits(self, layout: BucketLayout, params: list[ShardedParam]) -> bool:
        """Whether this buffer still serves `params` laid out by `layout` (else it is rebuilt)."""
        local = params[0].sharded_param._local_tensor
        return layout is self.layout and local.dtype == self.flat.dtype and local.device == self.flat.device

    def _slot(self, index: int, row: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Parameter `index`'s padded slot in `flat`, or in `row`, a tensor laid out as `flat`."""
        block = self.layout.blocks.index(index)
        row = self.flat if row is None else row
        return row[self.offsets[block] : self.offsets[block] + self.layout.widths[block]]

    @staticmethod
    def viewable(p: ShardedParam) -> bool:
        """Whether the shard can be a view of its slot: its valid rows are a prefix of the slot only
        when it is sharded on dim 0."""
        return p.shard_dim == 0

    def is_viewed_by(self, index: int, p: ShardedParam) -> bool:
        param = p.sharded_param
        view = self._views[index]
        # `swap_tensors` and a replacement give the parameter another local tensor.
        return view is not None and param._local_tensor is view

    def follow(self, params: list[ShardedParam]) -> None:
        """Make each shard that can be a view of its slot and is not (new, replaced, swapped) one,
        its values copied there first. Eager only: a trace must not write the buffer."""
        with torch.no_grad():
            for index in self.layout.blocks:
                if index == FLAGS:
                    continue
                p = params[index]
                if self.is_viewed_by(index, p):
                    continue
                if self.viewable(p):
                    view = self._slot(index)[: p.num_valid_rows * p.row_numel].view(p.num_valid_rows, *p.moved_size[1:])
                    p.live_in(view)
                    self._views[index] = view
        self.all_viewed = all(view is not None for view in self._views)

    def copy_in_others(self, params: list[ShardedParam]) -> None:
        """Before an eager gather: copy the shards that are not views (sharded on dim k > 0, moved
        first) into their slots, with `fsdp_graph::copy_in`."""
        for index in self.layout.blocks:
            if index != FLAGS and self._views[index] is None:
                p = params[index]
                torch.ops.fsdp_graph.copy_in.out([p.flat_local_shard()], [p.shard_numel], out=self._slot(index))

    def row_for_trace(self) -> Optional[torch.Tensor]:
        """`flat` if every parameter's local tensor was its view at the last `follow`, else None.

        A trace reads this without checking the views again: every trace begins by following the
        parameters ([Note: Tracing reads what was followed] in traced/callbacks.py), which runs
        `follow`, and a parameter replaced between compiled steps recompiles the step, which
        follows it first. Dynamo guards the flag, not the views: a guard on an attribute of the
        DTensor parameter would not survive `fsdp_graph.precompile`'s save and load (a pickled
        DTensor keeps no Python attributes). See [Note: Traced gathers read the shard buffer] in
        traced/unshard.py."""
        if not self.all_viewed:
            return None
        return self.grad_leaf if self.layout.reduced else self.flat


def shard_buffer_for(
    layout: BucketLayout,
    params: list[ShardedParam],
    current: Optional[ShardBuffer],
    pin_memory: bool = False,
    on_hand_out: Optional[Callable[[], None]] = None,
) -> Optional[ShardBuffer]:
    """The group's buffer for `layout`: `current` with replaced shards followed, or a new one where
    the layout, dtype or device changed, or None where the group cannot have one."""
    if ShardBuffer.reason_not(layout, params) is not None:
        return None
    if current is not None and current.fits(layout, params):
        current.follow(params)
        return current
    return ShardBuffer(layout, params, pin_memory, on_hand_out)
