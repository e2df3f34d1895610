"""How tensor parallelism laid a parameter out before `fully_shard`, and where its shard lives then.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import DeviceMesh, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh_info import MeshInfo


@dataclass(frozen=True)
class TensorParallelLayout:
    """How tensor parallelism split a parameter before `fully_shard` took it.

    Attributes:
        mesh: the 1-D tensor-parallel mesh the parameter is a DTensor on.
        placements: its placements there (`Shard(d)` or `Replicate()`).
    """

    mesh: DeviceMesh
    placements: tuple

    def num_shards(self, dim: int) -> int:
        """Into how many pieces tensor parallelism splits dim `dim`."""
        return math.prod(
            self.mesh.size(axis) for axis, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim
        )


def sharded_layout(
    mesh_info: MeshInfo, shard_dim: int, tp: TensorParallelLayout | None
) -> tuple[DeviceMesh, tuple]:
    """The mesh and placements of a sharded parameter. See [Note: Sharding a tensor-parallel parameter]."""
    if tp is None:
        return mesh_info.mesh, mesh_info.placements(shard_dim)
    split = tp.num_shards(shard_dim)
    dp_shard = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    dp_placements = (Replicate(), dp_shard) if mesh_info.is_hsdp else (dp_shard,)
    return DeviceMesh._concatenate([mesh_info.mesh, tp.mesh]), (*dp_placements, *tp.placements)
