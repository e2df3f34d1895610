"""`WholeMatrixOptimizer`: the owner machinery for optimizers whose update needs each matrix whole.

[Note: Whole-matrix updates on sharded parameters]
`fully_shard` leaves each rank a piece of every parameter (rows for `Shard(0)`). An elementwise
optimizer (AdamW) updates pieces independently; a matrix optimizer (Muon's Newton-Schulz, Shampoo's
preconditioners) needs the whole matrix. Gathering every matrix on every rank would repeat the
matrix work world-size times. Instead, each step:

1. prepare: every rank runs the elementwise part on its own pieces (Muon: the momentum update),
   giving its piece of the matrix to orthogonalize. State stays sharded, like the parameter.
2. own: every matrix gets one owner among all ranks of its mesh (both axes for HSDP), longest job
   first onto the least loaded rank by `matrix_cost` (owners.py: no rank exceeds its share plus
   one matrix). The plan needs only shapes, so every rank computes it alone.
3. gather: one all-to-all over the mesh's ranks sends each piece to its matrix's owner (under HSDP
   only the owner's replica sends: the others hold the same values).
4. update: each owner concatenates the pieces along the shard dim and calls `whole_matrix_update`
   once for all the matrices it owns in a param group. Each matrix's update is computed once in
   the world.
5. scatter: a second all-to-all sends each rank the piece of every update its shard holds (under
   HSDP every replica gets it), and `apply_update` applies it to the rank's piece of the parameter.

Pieces travel as bytes in `transport_dtype` (one all-to-all carries every dtype). A rank sends, per
step, its pieces of the matrices others own, and each owner the update pieces of the other ranks:
about 2 * (W-1)/W of the matrix elements for W ranks, at the transport dtype's size.
`last_step_sent_bytes` holds this rank's count (self-sends excluded) after each step.

What travels is less than whole matrices where the update treats blocks independently
(`independent_block`). Plain tensors (parameters `fully_shard` did not shard) are whole on every
rank: each rank updates them itself, as the unsharded optimizer does. A sharded parameter is cut by
its blocks along the shard dim (owners.py, `block_parts`): the whole blocks a rank's piece holds
alone are updated where they lie, and only the runs of blocks that a cut between two pieces crosses
are matrices for steps 2-5. For Muon a block is one matrix: a 2-D parameter is one crossed run (the
whole matrix, as above), and a stack of experts [E, M, N] under `Shard(0)` has none. For a
block-wise preconditioner with b x b blocks, a cut that is not a multiple of b sends one run of b
rows (or columns), and `whole_block_placement` (placement.py) picks a shard dim with no such cut
where one exists. See [Note: Structure-aware placement] there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.optim import Optimizer

from .owners import MeshRanks, ShardLayout, assign_owners, block_parts, shard_layout


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly DTensor) tensor, sharing its storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _Param:
    """One parameter with a gradient in one step: this rank's piece of what is to be updated, and of
    the update, which its jobs deliver."""

    param: torch.Tensor
    group: dict
    piece: torch.Tensor  # `prepare`'s result, in the transport dtype
    # This rank's piece of the update: the one job's result where a job covers the whole piece (no
    # copy), else a buffer each job writes its part of. Dies after `apply_update`.
    update: torch.Tensor | None = None


@dataclass
class _Job:
    """One matrix updated as one: the whole of a plain tensor, the blocks a piece holds alone, or a
    run of blocks that a cut between pieces crosses (then with its layout, and updated on an owner)."""

    group: dict
    layout: ShardLayout | None  # None: whole on this rank
    piece: torch.Tensor  # this rank's piece of the matrix (a view of its _Param's piece)
    target: _Param
    dim: int = 0  # where `piece` lies in the target's piece: along `dim`, from `offset`
    offset: int = 0

    def deliver(self, update: torch.Tensor) -> None:
        """Hand this rank's piece of the job's update to its parameter."""
        update = update.to(self.piece.dtype)  # as if it had travelled in the transport dtype
        target = self.target
        if self.piece.shape == target.piece.shape:  # the whole piece: the other jobs' parts are empty
            target.update = update
            return
        if target.update is None:
            target.update = torch.empty_like(target.piece)
        target.update.narrow(self.dim, self.offset, self.piece.size(self.dim)).copy_(update)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    if data.storage_offset() % dtype.itemsize:  # after a piece of a narrower dtype: not aligned for a view
        data = data.clone()
    return data.view(dtype).reshape(shape)


class WholeMatrixOptimizer(Optimizer):
    """Base class of matrix optimizers on `fully_shard`-ed parameters: each matrix's update runs once in
    the world, on its owner, over the whole matrix. See [Note: Whole-matrix updates on sharded parameters].

    A subclass defines the four hooks below (and may override `transport_dtype` and `check_param`);
    `step` does the rest. All hooks run under `torch.no_grad()`. `Muon` (muon.py) is one.

    - `prepare(group, param, state) -> Tensor`: on every rank, the elementwise part of the step on this
      rank's piece (`local(param)`, `local(param.grad)`, tensors in `state`); returns this rank's piece
      of the matrix the owner will need. Keep state tensors as DTensors shaped like the parameter
      (`torch.zeros_like(param.grad)`) so state dicts and checkpoints shard them as for AdamW.
    - `whole_matrix_update(group, matrices) -> list[Tensor]`: on the owner, the whole matrices of
      one param group (global shapes) to their whole updates.
    - `apply_update(group, param, update)`: on every rank, `update` is this rank's piece of the
      parameter's update; change `local(param)` in place.
    - `matrix_cost(group, shape) -> float`: the relative cost of `whole_matrix_update` on one matrix
      of `shape` (e.g. flops), for spreading matrices across ranks.
    - `independent_block(group, shape) -> tuple[int, ...]`: the shape of the blocks that
      `whole_matrix_update` updates independently of each other (the whole parameter by default).
      Blocks a rank's piece holds whole are updated where they lie; only blocks cut between
      ranks travel to an owner.
    """

    def __init__(self, params: Any, defaults: dict) -> None:
        self._mesh_ranks: dict[DeviceMesh, MeshRanks] = {}
        self.last_step_sent_bytes = 0
        super().__init__(params, defaults)

    # --- hooks for subclasses ---

    def check_param(self, param: torch.Tensor) -> None:
        """Refuse a parameter this optimizer cannot update (raise a `ValueError`)."""

    def transport_dtype(self, group: dict, param: torch.Tensor) -> torch.dtype:
        """The dtype pieces of matrices and of updates travel in (and `prepare`'s result is cast to).

        The parameter's dtype by default; narrower is fine where the update casts its input anyway.
        """
        return param.dtype

    def prepare(self, group: dict, param: torch.Tensor, state: dict) -> torch.Tensor:
        raise NotImplementedError

    def whole_matrix_update(self, group: dict, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def apply_update(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        raise NotImplementedError

    def matrix_cost(self, group: dict, shape: torch.Size) -> float:
        return float(shape.numel())

    def independent_block(self, group: dict, shape: torch.Size) -> tuple[int, ...]:
        """The shape of the blocks `whole_matrix_update` updates independently of each other.

        The contract: called on a sub-tensor of a parameter's matrix (of `shape`) that starts and ends
        on block edges, `whole_matrix_update` returns that sub-tensor of the whole update. Blocks tile
        the parameter from index 0; the last ones along a dim may be cut short by its end. Default:
        the whole parameter, i.e. no smaller independent unit.
        """
        return tuple(shape)

    # --- the machinery ---

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self.check_param(p)
            layout = shard_layout(p)  # refuses layouts it cannot rebuild
            if layout is not None and layout.mesh not in self._mesh_ranks:
                self._mesh_ranks[layout.mesh] = MeshRanks(layout.mesh)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: list[_Param] = []
        alone: list[_Job] = []  # updated on this rank, with no communication
        by_mesh: dict[DeviceMesh, list[_Job]] = {}  # updated on an owner
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                layout = shard_layout(p)
                piece = self.prepare(group, p, self.state[p]).to(self.transport_dtype(group, p))
                params.append(_Param(p, group, piece))
                if layout is None:
                    alone.append(_Job(group, None, piece, params[-1]))
                    continue
                ranks = self._ranks(layout.mesh)
                self._cut_by_blocks(group, layout, ranks, params[-1], alone, by_mesh.setdefault(layout.mesh, []))
        for group, jobs in _by_group([j for j in alone if j.piece.numel()]):
            updates = self.whole_matrix_update(group, [j.piece for j in jobs])
            for job, update in zip(jobs, updates):
                job.deliver(update)
        self.last_step_sent_bytes = 0
        for mesh, jobs in by_mesh.items():  # every rank sees the meshes in the same order
            if jobs:
                self._update_sharded(self._ranks(mesh), jobs)
        for entry in params:  # every rank calls apply_update for the same parameters
            update, entry.update = entry.update, None
            if update is None:  # an empty piece (e.g. no rows on this rank): nothing to deliver
                assert entry.piece.numel() == 0, entry.piece.shape
                update = torch.empty_like(entry.piece)
            self.apply_update(entry.group, entry.param, update)
        return loss

    def _ranks(self, mesh: DeviceMesh) -> MeshRanks:
        return self._mesh_ranks.get(mesh) or self._mesh_ranks.setdefault(mesh, MeshRanks(mesh))

    def _cut_by_blocks(self, group: dict, layout: ShardLayout, ranks: MeshRanks, entry: _Param,
                       alone: list[_Job], shared: list[_Job]) -> None:
        """The jobs of one sharded parameter: the whole blocks this rank's piece holds alone, and one
        job per run of blocks a cut between pieces crosses (every rank adds the same runs in the same
        order, its own part of each possibly empty). See [Note: Structure-aware placement]."""
        dim = layout.shard_dim
        (lo, hi), runs = block_parts(layout, self.independent_block(group, layout.shape), ranks.my_shard)
        if hi > lo:
            alone.append(_Job(group, None, entry.piece.narrow(dim, lo, hi - lo), entry, dim, lo))
        for run in runs:
            n = run.layout.piece_sizes[ranks.my_shard]
            shared.append(_Job(group, run.layout, entry.piece.narrow(dim, run.offset, n), entry, dim, run.offset))

    def _update_sharded(self, ranks: MeshRanks, jobs: list[_Job]) -> None:
        """Steps 2-5 of [Note: Whole-matrix updates on sharded parameters] for the jobs of one mesh."""
        owners = assign_owners([self.matrix_cost(j.group, j.layout.shape) for j in jobs], ranks.size)
        mine = [i for i, o in enumerate(owners) if o == ranks.my_index]
        dtypes = [j.piece.dtype for j in jobs]

        # gather: my piece of each matrix goes to its owner, if the owner is in my replica.
        send = [[] for _ in range(ranks.size)]  # by flat index
        for job, owner in zip(jobs, owners):
            if ranks.replica_of(owner) == ranks.my_replica:
                assert job.piece.shape == job.layout.piece_shape(ranks.my_shard), (job.piece.shape, job.layout)
                send[owner].append(_as_bytes(job.piece))
        recv_nbytes = [[] for _ in range(ranks.size)]
        for s in range(ranks.num_shards):  # the owner hears from every shard of its own replica
            source = ranks.my_replica * ranks.num_shards + s
            recv_nbytes[source] = [_nbytes(dtypes[i], jobs[i].layout.piece_shape(s)) for i in mine]
        device = jobs[0].piece.device
        received = self._all_to_all(ranks, send, recv_nbytes, device)

        # update: whole matrices on their owner, one call per param group.
        whole = [
            torch.cat([_from_bytes(received[ranks.my_replica * ranks.num_shards + s][k], dtypes[i],
                                   jobs[i].layout.piece_shape(s)) for s in range(ranks.num_shards)],
                      dim=jobs[i].layout.shard_dim)
            for k, i in enumerate(mine)
        ]
        updates: dict[int, torch.Tensor] = {}
        for group, indexed in _by_group([(i, jobs[i]) for i in mine], indexed=True):
            results = self.whole_matrix_update(group, [whole[mine.index(i)] for i, _ in indexed])
            for (i, job), result in zip(indexed, results):
                assert result.shape == job.layout.shape, (result.shape, job.layout.shape)
                updates[i] = result.to(dtypes[i])

        # scatter: every rank gets its shard's piece of each update, from the update's owner.
        send = [[] for _ in range(ranks.size)]
        for i in mine:
            pieces = jobs[i].layout.split(updates[i])
            for dest in range(ranks.size):
                send[dest].append(_as_bytes(pieces[ranks.shard_of(dest)]))
        recv_nbytes = [[] for _ in range(ranks.size)]
        for i, (job, owner) in enumerate(zip(jobs, owners)):
            recv_nbytes[owner].append(_nbytes(dtypes[i], job.layout.piece_shape(ranks.my_shard)))
        received = self._all_to_all(ranks, send, recv_nbytes, device)
        position = [0] * ranks.size
        for i, (job, owner) in enumerate(zip(jobs, owners)):
            data = received[owner][position[owner]]
            position[owner] += 1
            job.deliver(_from_bytes(data, dtypes[i], job.layout.piece_shape(ranks.my_shard)))

    def _all_to_all(self, ranks: MeshRanks, send: list[list[torch.Tensor]],
                    recv_nbytes: list[list[int]], device: torch.device) -> list[list[torch.Tensor]]:
        """One all-to-all over the mesh's ranks: `send[d]` (byte tensors) to flat index d; returns, per
        source flat index, the received byte tensors, cut by `recv_nbytes[source]`."""
        order = sorted(range(ranks.size), key=lambda d: ranks.group_rank[d])  # the group's rank order
        send_sizes = [sum(t.numel() for t in send[d]) for d in order]
        recv_sizes = [sum(recv_nbytes[d]) for d in order]
        chunks = [t for d in order for t in send[d]]
        send_buffer = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
        recv_buffer = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        if ranks.size == 1:
            recv_buffer.copy_(send_buffer)
        else:
            dist.all_to_all_single(recv_buffer, send_buffer, recv_sizes, send_sizes, group=ranks.group)
        me = ranks.group_rank[ranks.my_index]
        self.last_step_sent_bytes += sum(n for d, n in zip(order, send_sizes) if ranks.group_rank[d] != me)
        received: list[list[torch.Tensor]] = [[] for _ in range(ranks.size)]
        offset = 0
        for d in order:
            for n in recv_nbytes[d]:
                received[d].append(recv_buffer[offset:offset + n])
                offset += n
        return received


def _nbytes(dtype: torch.dtype, shape: torch.Size) -> int:
    return shape.numel() * dtype.itemsize


def _by_group(items: list, indexed: bool = False):
    """`items` (jobs, or (index, job) pairs) grouped by param group, in first-appearance order."""
    groups: dict[int, tuple[dict, list]] = {}
    for item in items:
        job = item[1] if indexed else item
        groups.setdefault(id(job.group), (job.group, []))[1].append(item)
    return list(groups.values())
