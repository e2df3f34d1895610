"""All-gather extensions: a sharded parameter whose shard brings its own all-gather (e.g. float8).

[Note: All-gather extensions]
FSDP2's contract for tensor subclasses: when the local shard has `fsdp_pre_all_gather` and
`fsdp_post_all_gather` (defined by its class, or set on the tensor instance: [Note: Extensions found
on the tensor instance]), the all-gather carries what the pre-hook returns instead of the shard,

    (inputs, metadata) = shard.fsdp_pre_all_gather(mesh, orig_size, orig_stride, module, mp_policy)
    (tensor, to_free)  = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)        # first time
    shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded_param)         # later

where `outputs[i]` is `inputs[i]` gathered over the shard group on dim 0 (e.g. float8 data, 1 byte
per element instead of 4) and the unsharded parameter is `tensor`'s first rows. As in FSDP2 the
pre-hook gets this rank's unpadded shard and the shard axis' 1-D mesh; a rank holding fewer than
`padded_dim0` rows (the layout in runtime/param.py) must return inputs of the padded shard size, so
every rank's inputs match. The post-hook's `out=` call refills the parameter autograd may have
saved: it must not bump its version counter (FSDP2 leaves that to the hook too). A group with such a
parameter gathers one byte bucket (every input, and the other parameters' padded shards, viewed as
uint8) and reshards fully after forward (an int `reshard_after_forward` would re-gather from bytes
the post-hook already consumed). Gradients are the unsharded parameter's, reduce-scattered as usual.
Both runtimes call the hooks through `call_pre_all_gather` and `call_post_all_gather`, in a form
Dynamo inlines, so compiled steps trace them into the graph: [Note: Traced all-gather extensions] in
traced/unshard.py.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh

from .policies import MixedPrecisionPolicy
from .storage import contiguous_stride, refill


class AllGatherExtensions:
    """The all-gather extension side of a `ShardedParam` (runtime/param.py), which inherits it.

    It reads the parameter's name, shard and layout (`fqn`, `sharded_param`, `local_shard`,
    `mesh_info`, `shard_dim`, `tp`, `orig_size`, `padded_dim0`, `num_valid_rows`, `owners`,
    `device`, `unsharded_dtype`, `requires_grad`) and owns what `_init_all_gather_extensions` sets.
    It also drops the unsharded parameter (`unsharded_param` and its storage) when the hooks
    appear or go away, and makes it from the post-hook's result.
    """

    def _init_all_gather_extensions(self, mp_policy: MixedPrecisionPolicy | None, shard_cls: type) -> None:
        """At `fully_shard`, once the sharded parameter exists; `shard_cls` is the shard's class before it
        became a DTensor's local tensor."""
        self.mp_policy = mp_policy  # passed to fsdp_pre_all_gather
        # The hooks are looked up on the local shard before every all-gather; `gather_hooks` is what
        # the eager runtime found last time.
        self._shard_mesh = self._hook_mesh()
        self.gather_hooks = self.has_gather_hooks()
        self._check_hooks_survived_sharding(shard_cls)
        self._gather_metadata = None  # the pre-hook's metadata, until the post-hook takes it
        self._gather_outputs: list[torch.Tensor] = []  # one per pre-hook input, (world * rows, ...)
        self._to_free: tuple[torch.Tensor, ...] = ()  # what the post-hook asked to free on reshard

    def _find_hook(self, name: str, owner: torch.Tensor):
        """`(hook, on_instance)`: the all-gather extension `name` of `owner`, the sharded parameter's local
        tensor, or `(None, False)`.

        [Note: Extensions found on the tensor instance]
        FSDP2 looks the hooks up on the sharded parameter's local tensor at every all-gather, as
        `local.fsdp_pre_all_gather(...)`: a user may set them on the tensor instance (after
        `fully_shard`, or after `to_empty()`, which makes new local tensors), with or without a
        subclass. So the lookup happens here each time, on `sharded_param._local_tensor` (the object
        the user patched; `to_local()` returns a new alias without its attributes). An instance
        attribute wins, as in Python, and is called as stored (a bound method, or a function that
        takes no self); a class's hook is called through the class with the shard as self, which
        Dynamo inlines (a method call on a subclass instance is an op to Dynamo), and under Dynamo
        `getattr` on a subclass instance does not see the class's hook at all, hence the fallback.
        """
        class_hook = getattr(type(owner), name, None)
        hook = getattr(owner, name, None)
        if hook is None or (class_hook is not None and getattr(hook, "__func__", None) is class_hook):
            return class_hook, False
        return hook, True

    def has_gather_hooks(self) -> bool:
        """Whether the local shard has all-gather extensions now, checked; both runtimes ask before
        each all-gather. See [Note: Extensions found on the tensor instance]."""
        local = self.sharded_param._local_tensor
        pre, pre_on_instance = self._find_hook("fsdp_pre_all_gather", local)
        post, _ = self._find_hook("fsdp_post_all_gather", local)
        if (pre is None) != (post is None):
            raise ValueError(
                f"Parameter '{self.fqn}' is a {type(local).__name__}, which defines only "
                f"one of fsdp_pre_all_gather and fsdp_post_all_gather; define both or neither"
            )
        if pre is None:
            return False
        if self.shard_dim != 0:
            raise ValueError(
                f"Parameter '{self.fqn}' has fsdp_pre_all_gather, which fsdp_graph supports on dim 0 only; "
                f"return Shard(0) or None from shard_placement_fn for it"
            )
        if self.tp is not None:
            raise ValueError(
                f"Parameter '{self.fqn}' has fsdp_pre_all_gather and is a tensor-parallel DTensor; fsdp_graph "
                f"supports all-gather extensions on plain parameters only: apply the subclass to a model "
                f"without tensor parallelism, or use a plain parameter here"
            )
        if self._shard_mesh is None:
            raise ValueError(
                f"Parameter '{self.fqn}' has fsdp_pre_all_gather, which is given the shard axis' mesh, but the "
                f"{self.mesh_info.mesh.ndim}-D mesh has no dim names to slice it by; build it with "
                f"init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        num_args = _num_hook_args(pre, pre_on_instance)
        if num_args not in (1, 5):
            raise TypeError(
                f"fsdp_pre_all_gather of '{self.fqn}' ({type(self.sharded_param._local_tensor).__name__}) "
                f"takes {num_args} arguments; FSDP2's contract is (mesh, orig_size, orig_stride, module, "
                f"mp_policy), or (mesh) in its older form"
            )
        return True

    def _check_hooks_survived_sharding(self, cls: type) -> None:
        """At `fully_shard`: a parameter whose class has the hooks must still have them on its shard."""
        pre, post = hasattr(cls, "fsdp_pre_all_gather"), hasattr(cls, "fsdp_post_all_gather")
        if pre != post:
            raise ValueError(
                f"Parameter '{self.fqn}' is a {cls.__name__}, which defines only one of fsdp_pre_all_gather "
                f"and fsdp_post_all_gather; define both or neither"
            )
        if pre and not self.gather_hooks:
            raise ValueError(
                f"Parameter '{self.fqn}' is a {cls.__name__} with fsdp_pre_all_gather, but its shard (the "
                f"DTensor's local tensor) is a {type(self.sharded_param._local_tensor).__name__}: the subclass "
                f"does not survive detach, slicing and views, so its hooks would never run; keep the subclass "
                f"through those ops in its __torch_dispatch__, or set the hooks on the local tensor after fully_shard"
            )

    def refresh_gather_hooks(self) -> bool:
        """Eager runtime, before an all-gather: look the hooks up again. Set or removed since the
        last all-gather, the unsharded parameter is rebuilt from scratch (the post-hook's first-time
        form makes it, or a plain gather fills a new one); the group is sharded then."""
        found = self.has_gather_hooks()
        if found != self.gather_hooks:
            self._unsharded_padded = self._unsharded_local = self.unsharded_param = None
            self._gather_outputs, self._to_free, self._gather_metadata = [], (), None
            self.gather_hooks = found
        return found

    def call_pre_all_gather(self, local: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """`(inputs, metadata)` of the pre-hook on this rank's shard `local`, checked. Both
        runtimes call it; see [Note: All-gather extensions]."""
        hook, on_instance = self._find_hook("fsdp_pre_all_gather", self.sharded_param._local_tensor)
        if _num_hook_args(hook, on_instance) == 1:  # FSDP2's older signature: the mesh only
            args = (self._shard_mesh,)
        else:
            args = (self._shard_mesh, self.orig_size, contiguous_stride(self.orig_size), self.owners[0][0], self.mp_policy)
        result = hook(*args) if on_instance else hook(local, *args)
        inputs = self._check_pre_all_gather_result(result)
        padded_size = (self.padded_dim0, *self.orig_size[1:])
        if self.num_valid_rows != self.padded_dim0 and any(tuple(t.shape) != padded_size for t in inputs):
            # Only the ranks with padding can tell: the others' inputs have the right size.
            raise ValueError(
                f"'{self.fqn}' is sharded unevenly ({self.orig_size[0]} rows over {self.mesh_info.shard_size} "
                f"ranks; this rank holds {self.num_valid_rows}), and its fsdp_pre_all_gather returned inputs of "
                f"sizes {[tuple(t.shape) for t in inputs]}; pad each input to the padded shard size {padded_size} "
                f"(rows ceil(orig_size[0] / mesh.size())), as FSDP2 requires"
            )
        return inputs, result[1]

    def call_post_all_gather(
        self, local: torch.Tensor, outputs: tuple[torch.Tensor, ...], metadata: object, out: torch.Tensor | None = None
    ):
        """The post-hook, found as the pre-hook. Its first-time form (no `out`) returns the unsharded
        parameter (its valid rows) and what to free on reshard, checked; with `out` it refills it."""
        hook, on_instance = self._find_hook("fsdp_post_all_gather", self.sharded_param._local_tensor)
        args = (outputs, metadata, self.unsharded_dtype)
        kwargs = {} if out is None else {"out": out}
        result = hook(*args, **kwargs) if on_instance else hook(local, *args, **kwargs)
        if out is not None:
            return None
        tensor = result[0] if isinstance(result, tuple) and len(result) == 2 else None
        if not isinstance(tensor, torch.Tensor) or tensor.shape[0] < self.orig_size[0] or (
            tensor.shape[1:] != self.orig_size[1:]
        ):
            raise TypeError(
                f"fsdp_post_all_gather of '{self.fqn}' returned {type(result).__name__} {result!r:.200}; "
                f"return (unsharded, tensors_to_free) where unsharded has the gathered rows "
                f"(at least {self.orig_size[0]}) and the parameter's trailing dims {tuple(self.orig_size[1:])}"
            )
        return tensor[: self.orig_size[0]], tuple(result[1])

    def pre_all_gather(self) -> list[torch.Tensor]:
        """Eager runtime: the pre-hook's all-gather inputs for this rank, checked against the first
        all-gather's, its metadata kept for the post-hook ([Note: All-gather extensions])."""
        local = self.local_shard.to(self.device)  # an offloaded shard is gathered from the device
        inputs, self._gather_metadata = self.call_pre_all_gather(local)
        world = self.mesh_info.shard_size
        sizes = [(world * t.shape[0], *t.shape[1:]) for t in inputs]
        if not self._gather_outputs:
            self._gather_outputs = [
                torch.empty(size, dtype=t.dtype, device=self.device) for size, t in zip(sizes, inputs)
            ]
        expected = [(tuple(t.shape), t.dtype) for t in self._gather_outputs]
        if [(size, t.dtype) for size, t in zip(sizes, inputs)] != expected:
            raise ValueError(
                f"fsdp_pre_all_gather of '{self.fqn}' returned inputs of shapes and dtypes "
                f"{[(tuple(t.shape), t.dtype) for t in inputs]}, which changed since the first all-gather "
                f"(gathered: {expected}); return the same shapes and dtypes every time"
            )
        return inputs

    def _hook_mesh(self) -> DeviceMesh | None:
        """The mesh the pre-hook is given: the shard axis' (FSDP2's `shard_mesh`), 1-D under HSDP too;
        None for a 2-D mesh without dim names (an error once a parameter has the hooks)."""
        mesh = self.mesh_info.mesh
        if mesh.ndim == 1:
            return mesh
        if mesh.mesh_dim_names is None:
            return None
        return mesh[mesh.mesh_dim_names[self.mesh_info.shard_axis]]

    def _check_pre_all_gather_result(self, result) -> list[torch.Tensor]:
        """The all-gather inputs of a pre-hook's `(inputs, metadata)`, or a TypeError naming the fix."""
        inputs = result[0] if isinstance(result, tuple) and len(result) == 2 else None
        if not isinstance(inputs, (tuple, list)) or not inputs or not all(
            isinstance(t, torch.Tensor) and t.ndim >= 1 for t in inputs
        ):
            raise TypeError(
                f"fsdp_pre_all_gather of '{self.fqn}' returned {type(result).__name__} {result!r:.200}; "
                f"return (all_gather_inputs, metadata) where all_gather_inputs is a non-empty tuple of tensors "
                f"with at least one dim (each is gathered on dim 0)"
            )
        return list(inputs)

    def alloc_gather_outputs(self, world: int) -> list[torch.Tensor]:
        """The pre-hook inputs' gathered outputs as (world, bytes per rank) views to copy out into."""
        for t in self._gather_outputs:
            refill(t)
        return [t.view(world, -1).view(torch.uint8) for t in self._gather_outputs]

    def post_all_gather(self) -> None:
        """Rebuild the unsharded parameter from the gathered inputs ([Note: All-gather extensions])."""
        local = self.local_shard
        if self.unsharded_param is None:
            tensor, self._to_free = self.call_post_all_gather(local, tuple(self._gather_outputs), self._gather_metadata)
            self.unsharded_param = nn.Parameter(tensor, self.requires_grad)
        else:
            for t in self._to_free:
                refill(t)
            self.call_post_all_gather(local, tuple(self._gather_outputs), self._gather_metadata, out=self.unsharded_param)
        self._gather_metadata = None


def _num_hook_args(hook, on_instance: bool) -> int:
    """How many arguments a pre-hook takes after self: all of an instance attribute's (bound, or
    a function called without self), a class function's but the first."""
    num = len(inspect.signature(hook).parameters)
    return num if on_instance or inspect.ismethod(hook) else num - 1

