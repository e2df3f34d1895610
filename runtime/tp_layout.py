"""How tensor parallelism laid a parameter out before `fully_shard`, and where its shard lives then;
the tp DTensor the module computes with, and the tp-local pieces of global tensors and gradients.

[Note: Sharding a tensor-parallel parameter]
A parameter that tensor parallelism already made a DTensor (`parallelize_module` on a `tp` mesh) is
sharded as its tp-local tensor: the layout in runtime/param.py is said of `param.to_local()`, so the
all-gather over the data-parallel ranks rebuilds exactly the tensor this tp rank computes with, and the
unsharded parameter is that tensor wrapped again as a DTensor with the tp placements, as
`parallelize_module` left it. Gradients arrive as tp DTensors; their local tensors (after moving
them to the parameter's tp placements, e.g. Partial to Replicate) are reduce-scattered over the
data-parallel ranks only. The sharded parameter is a DTensor over the mesh (dp..., tp) with
placements (dp placements..., tp placement). When tp already splits the sharded dim into n pieces,
the dp shard is a chunk of a tp chunk, not a chunk of the global tensor: DTensor spells that
`_StridedShard(dim, split_factor=n)` on the dp axis, and torch's `fully_shard` writes the same,
so state dicts and checkpoints of both interoperate.

[Note: Parameters on the whole SPMD mesh]
With `dp_mesh_dims` (FSDP2's `DataParallelMeshDims`, torchtitan's `full_dtensor` backend) a parameter
is already a DTensor on the whole mesh, data-parallel axes included, where it is `Replicate()`. It is
sharded as above, its local tensor being what this rank computes with; what differs is where it
lives: the sharded parameter is a DTensor on that same mesh, the shard axis's `Replicate()` replaced
by the dp placement (`Shard(dim)`, or `_StridedShard(dim, split_factor=n)` where axes after it split
the dim n ways; several shard axes are flattened into one), and the unsharded parameter is the
original placements again. A gradient keeps whatever placement it has on the data-parallel axes
(typically `Partial()`, from inputs sharded over the batch): its local tensor is what the
reduce-scatter averages, as FSDP2 takes it; only the other axes are moved to the parameter's
placements first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh_info import MeshInfo
from .storage import contiguous_stride


@dataclass(frozen=True)
class TensorParallelLayout:
    """How tensor parallelism split a parameter before `fully_shard` took it.

    Attributes:
        mesh: the mesh the parameter is a DTensor on: the 1-D tensor-parallel mesh, or the whole
            SPMD mesh ([Note: Parameters on the whole SPMD mesh]).
        placements: its placements there (`Shard(d)` or `Replicate()`).
        shard_axes: the axes of `mesh` `fully_shard` shards on (whole SPMD mesh only), else ().
        replicate_axes: the axes of `mesh` replicating the shards (HSDP on the whole SPMD mesh).
    """

    mesh: DeviceMesh
    placements: tuple
    shard_axes: tuple[int, ...] = ()
    replicate_axes: tuple[int, ...] = ()

    @property
    def dp_axes(self) -> frozenset[int]:
        return frozenset(self.shard_axes + self.replicate_axes)

    def grad_placements(self, grad_placements: tuple) -> tuple:
        """Where a gradient must be before its local tensor is reduce-scattered: the parameter's
        placements, except on data-parallel axes, where it stays as it is."""
        dp = self.dp_axes
        return tuple(g if axis in dp else p for axis, (g, p) in enumerate(zip(grad_placements, self.placements)))

    def num_shards(self, dim: int) -> int:
        """Into how many pieces tensor parallelism splits dim `dim`."""
        return math.prod(
            self.mesh.size(axis) for axis, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim
        )

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a global tensor of the parameter's shape: DTensor's chunking, as
        `distribute_tensor` cuts it."""
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                pieces = torch.chunk(full, self.mesh.size(axis), dim=placement.dim)
                rank = self.mesh.get_local_rank(axis)
                full = pieces[rank] if rank < len(pieces) else full.narrow(placement.dim, 0, 0)
        return full

    def dtensor(self, local: torch.Tensor, size: torch.Size) -> DTensor:
        """The tp-local unsharded tensor `local` as the DTensor `parallelize_module` made, of global
        shape `size`. Its backward hands `local` the gradient on the tp placements (e.g. Partial
        summed to Replicate)."""
        if self.dp_axes:  # [Note: Parameters on the whole SPMD mesh]
            return _OnWholeMesh.apply(
                local, self.mesh, self.placements, tuple(sorted(self.dp_axes)), size, contiguous_stride(size),
            )
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=size, stride=contiguous_stride(size),
        )

    def local_grad(self, grad: DTensor) -> torch.Tensor:
        """A gradient of the unsharded parameter as the local tensor the reduce-scatter packs."""
        placements = self.grad_placements(tuple(grad.placements))
        if tuple(grad.placements) != placements:  # e.g. Partial where the parameter is Replicate
            grad = grad.redistribute(placements=placements)
        return grad.to_local()


def tensor_parallel_layout(
    param: torch.Tensor, spmd_axes: tuple[tuple[int, ...], tuple[int, ...]]
) -> TensorParallelLayout | None:
    """How tensor parallelism laid `param` out, or None for a plain tensor. `spmd_axes`: the shard
    and replicate axes of `dp_mesh_dims` on the parameter's own mesh ([Note: Parameters on the
    whole SPMD mesh])."""
    if not isinstance(param, DTensor):
        return None
    return TensorParallelLayout(param.device_mesh, tuple(param.placements), *spmd_axes)


def sharded_layout(
    mesh_info: MeshInfo, shard_dim: int, tp: TensorParallelLayout | None
) -> tuple[DeviceMesh, tuple]:
    """The mesh and placements of a sharded parameter. See [Note: Sharding a tensor-parallel parameter]."""
    if tp is None:
        return mesh_info.mesh, mesh_info.placements(shard_dim)
    if tp.shard_axes:
        return _spmd_sharded_layout(mesh_info, shard_dim, tp)
    split = tp.num_shards(shard_dim)
    dp_shard = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    dp_placements = (Replicate(), dp_shard) if mesh_info.is_hsdp else (dp_shard,)
    return DeviceMesh._concatenate([mesh_info.mesh, tp.mesh]), (*dp_placements, *tp.placements)


def _spmd_sharded_layout(mesh_info: MeshInfo, shard_dim: int, tp: TensorParallelLayout) -> tuple[DeviceMesh, tuple]:
    """[Note: Parameters on the whole SPMD mesh]: the whole mesh with the shard axes' placement."""
    last_shard_axis = tp.shard_axes[-1]
    split = math.prod(
        tp.mesh.size(axis) for axis, p in enumerate(tp.placements)
        if axis > last_shard_axis and isinstance(p, Shard) and p.dim == shard_dim
    )
    dp_shard = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    if len(tp.shard_axes) == 1:
        placements = list(tp.placements)
        placements[last_shard_axis] = dp_shard
        return tp.mesh, tuple(placements)
    # Several shard axes, flattened into the data-parallel mesh's shard axis: one axis in their place.
    names = tp.mesh.mesh_dim_names
    meshes, placements = [], []
    for axis, placement in enumerate(tp.placements):
        if axis == tp.shard_axes[0]:
            meshes.append(mesh_info.mesh[mesh_info.mesh.mesh_dim_names[mesh_info.shard_axis]])
            placements.append(dp_shard)
        elif axis not in tp.shard_axes:
            meshes.append(tp.mesh[names[axis]])
            placements.append(placement)
    return DeviceMesh._concatenate(meshes), tuple(placements)


class _OnWholeMesh(torch.autograd.Function):
    """The unsharded local tensor as a DTensor on the whole SPMD mesh; its backward hands the
    local tensor the gradient as FSDP2 takes it: moved to the parameter's placements on every axis
    but the data-parallel ones, where it stays as it is ([Note: Parameters on the whole SPMD mesh]).
    `DTensor.from_local` would move those too: a gradient labelled `Replicate()` there (a
    `local_map` output, e.g. torchtitan's embedding) made `Partial()` is divided by the axis size.

    In the graph as one call (`allow_in_graph`): Dynamo would trace the backward once, for a
    gradient placed as the forward's output, and keep that plan for the real gradient."""

    @staticmethod
    def forward(ctx, local, mesh, placements, dp_axes, size, stride):
        ctx.placements, ctx.dp_axes = placements, dp_axes
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=size, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        placements = tuple(g if axis in ctx.dp_axes else p for axis, (g, p) in enumerate(zip(grad.placements, ctx.placements)))
        if tuple(grad.placements) != placements:
            grad = grad.redistribute(placements=placements)
        return grad.to_local(), None, None, None, None, None


torch._dynamo.allow_in_graph(_OnWholeMesh)
