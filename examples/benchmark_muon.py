"""Benchmark Muon on sharded parameters: torch.optim.Muon unsharded, torch's fully_shard + torch.optim.Muon,
and fully_shard + fsdp_graph.optim.Muon, side by side in one run.

CPU / gloo:
    torchrun --nproc-per-node 2 examples/benchmark_muon.py
    torchrun --nproc-per-node 2 examples/benchmark_muon.py --dim 256 --layers 4 --markdown muon.md

The matrices are the 2-D weights of the example Llama's blocks (attention and feed-forward), what
Muon is meant for. Every side gets the same global gradients each step (seeded random matrices; an
FSDP side gets its shard of them), so the updates must agree. Per side it prints:

- the optimizer step time (median of `--rounds` steps; sides alternate who goes first);
- the bytes one rank sends per optimizer step (a dispatch mode adding up every collective's bytes:
  all-gather (W-1)/W of the output, reduce-scatter (W-1)/W of the input, all-reduce 2(W-1)/W, all-to-all
  what leaves the rank), beside the bytes of one AdamW training step of the same model on
  fsdp_graph's runtime (its all-gathers and reduce-scatters), where the AdamW step itself sends nothing;
- the largest relative error (Frobenius, over matrices and steps) of its update against the
  unsharded update; after each step every side's parameters are reset to the unsharded ones, so each
  step's updates start from the same state (momentum depends on the gradients only).

With and without structure-aware placement (`whole_block_placement`, docs/optim.md): one more Muon
row under the placement for Muon's blocks (one matrix each), and a second table (`--block-size B`,
0 to skip) for a block-wise optimizer, examples/block_polar.py's `BlockPolarSGD` with B x B blocks:
unsharded, under fully_shard's default `Shard(0)`, and under `whole_block_placement((B, B), W)`.

This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from bench_report import init_cpu_ranks, write_markdown
from block_polar import BlockPolarSGD
from llama import Llama, LlamaConfig, llama_config, shard_llama

from fsdp_graph import fully_shard
from fsdp_graph.optim import Muon, whole_block_placement


class CommBytes(TorchDispatchMode):
    """Adds up the bytes this rank sends through collectives (functional and c10d ops) on the default
    group (the all-to-all's own split is found by the global rank)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # let DTensor run its op: the mode sees its collectives
            return NotImplemented
        name = getattr(func, "name", lambda: "")()
        if name.startswith(("_c10d_functional::", "c10d::")):
            self.sent += self._bytes(name.split("::")[1], args)
        return func(*args, **(kwargs or {}))

    def _bytes(self, op: str, args) -> int:
        w = self.world_size
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        if not tensors or "wait" in op or "barrier" in op:
            return 0
        if "allgather" in op or "all_gather" in op:  # (output, input) for c10d; (input, ...) functional
            shard = tensors[-1] if op.startswith(("_allgather_base", "allgather_into")) else tensors[0]
            return shard.nbytes * (w - 1)
        if "reduce_scatter" in op:
            full = tensors[-1] if op.startswith("_reduce_scatter_base") else tensors[0]
            return full.nbytes * (w - 1) // w
        if "allreduce" in op or "all_reduce" in op:
            return 2 * sum(t.nbytes for t in tensors) * (w - 1) // w
        if "alltoall" in op or "all_to_all" in op:  # all but this rank's own split
            source, splits = (args[1], args[4]) if op.startswith("alltoall_base") else (args[0], args[2])
            row_bytes = source.nbytes // max(1, source.shape[0])
            own = splits[dist.get_rank()] if splits else source.shape[0] // w
            return source.nbytes - own * row_bytes
        if "broadcast" in op:
            return sum(t.nbytes for t in tensors) * (w - 1) // w
        if any(word in op for word in ("gather", "scatter", "reduce", "send", "recv")):
            raise NotImplementedError(f"count the bytes of {op}")
        return 0  # not a collective (e.g. _wrap_tensor_autograd)


def matrices(model: Llama) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()  # a snapshot, never a view


class Side:
    def __init__(self, name: str, cfg: LlamaConfig, shard_fn, optimizer_cls, shard_kwargs=None, **optim_kwargs) -> None:
        self.name = name
        torch.manual_seed(0)
        model = Llama(cfg)
        self.model = shard_llama(model, shard_fn, **(shard_kwargs or {})) if shard_fn is not None else model
        self.params = matrices(self.model)
        self.optimizer = optimizer_cls(self.params, **optim_kwargs)
        self.times: list[float] = []
        self.errors: list[float] = []
        self.sent_bytes = 0

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()

    def timed_step(self) -> None:
        dist.barrier()
        start = time.perf_counter()
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)

    def set_params(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values):
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(v, p.device_mesh, p.placements).to_local())
                else:
                    p.copy_(v)

    def measure_bytes(self, grads: list[torch.Tensor], world_size: int) -> None:
        self.set_grads(grads)
        with CommBytes(world_size) as counter:
            self.optimizer.step()
        self.sent_bytes = counter.sent
        own_count = getattr(self.optimizer, "last_step_sent_bytes", None)  # fsdp_graph's Muon counts its own
        if own_count is not None and own_count != counter.sent:
            print(f"rank {dist.get_rank()}: {self.name} counted {own_count} bytes itself, the dispatch mode {counter.sent}")


def adamw_training_bytes(cfg: LlamaConfig, args, world_size: int) -> int:
    """Bytes one rank sends in one AdamW training step of the whole model on fsdp_graph's runtime."""
    torch.manual_seed(0)
    model = shard_llama(Llama(cfg), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1))
    with CommBytes(world_size) as counter:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
    return counter.sent


def global_grads(shapes: list[torch.Size], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) * 1e-2 for s in shapes]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank, for the AdamW bytes")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32, help="BlockPolarSGD's blocks (0: skip its table)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    return parser.parse_args()


def one_matrix(shape: torch.Size) -> tuple[int, ...]:
    """Muon's independent blocks: each matrix of a stack."""
    return (1,) * (len(shape) - 2) + tuple(shape[-2:])


def main() -> None:
    args = parse_args()
    rank, world_size = init_cpu_ranks()
    cfg = llama_config(args.dim, args.layers, args.seq_len)
    kwargs = {"lr": 0.02, "weight_decay": 0.1}
    muon_sides = [
        Side("torch Muon, unsharded", cfg, None, torch.optim.Muon, **kwargs),
        Side("torch fully_shard + torch Muon", cfg, torch_fully_shard, torch.optim.Muon, **kwargs),
        Side("fsdp_graph fully_shard + fsdp_graph Muon", cfg, fully_shard, Muon, **kwargs),
        Side("fsdp_graph fully_shard + fsdp_graph Muon, whole_block_placement (one matrix)", cfg, fully_shard, Muon,
             {"shard_placement_fn": whole_block_placement(one_matrix, world_size)}, **kwargs),
    ]
    tables = [muon_sides]
    if args.block_size:
        b = args.block_size
        block_kwargs = {"lr": 0.005, "block_size": b}
        tables.append([
            Side("BlockPolarSGD, unsharded", cfg, None, BlockPolarSGD, **block_kwargs),
            Side("fsdp_graph fully_shard (Shard(0)) + BlockPolarSGD", cfg, fully_shard, BlockPolarSGD, **block_kwargs),
            Side(f"fsdp_graph fully_shard + BlockPolarSGD, whole_block_placement(({b}, {b}))", cfg, fully_shard,
                 BlockPolarSGD, {"shard_placement_fn": whole_block_placement((b, b), world_size)}, **block_kwargs),
        ])
    shapes = [p.shape for p in muon_sides[0].params]
    if rank == 0:
        print(f"{len(shapes)} matrices of the blocks of a Llama (dim {args.dim}, {args.layers} blocks), "
              f"{sum(s.numel() for s in shapes) / 1e6:.2f}M entries, {world_size} gloo ranks, {args.rounds} rounds", flush=True)
    for sides in tables:
        run_side_by_side(sides, shapes, args)
        for side in sides:
            side.measure_bytes(global_grads(shapes, 0), world_size)
    adamw_bytes = adamw_training_bytes(cfg, args, world_size)
    if rank == 0:
        report(args, tables, adamw_bytes, world_size)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


def run_side_by_side(sides: list[Side], shapes: list[torch.Size], args) -> None:
    """Warm-up and timed steps, sides alternating who goes first; sides[0] (unsharded) is the reference."""
    reference = sides[0]
    for step in range(args.warmup + args.rounds):
        grads = global_grads(shapes, step)
        start = [p.detach().clone() for p in reference.params]
        order = sides if step % 2 == 0 else list(reversed(sides))
        for side in order:
            side.set_grads(grads)
            if step < args.warmup:
                side.optimizer.step()
            else:
                side.timed_step()
        expected = [p.detach() - s for p, s in zip(reference.params, start)]
        for side in sides[1:]:
            got = [full(p) - s for p, s in zip(side.params, start)]
            side.errors.append(max(((g - e).norm() / e.norm()).item() for g, e in zip(got, expected)))
            side.set_params([p.detach() for p in reference.params])


def report(args, tables: list[list[Side]], adamw_bytes: int, world_size: int) -> None:
    print(f"AdamW training step (forward + backward + step) of the whole model on fsdp_graph: "
          f"{adamw_bytes / 2**20:.3f} MiB sent per rank")
    markdown = []
    for sides in tables:
        base = statistics.median(sides[0].times)
        torch_sharded = statistics.median(sides[1].times) if sides[1].optimizer.__class__ is torch.optim.Muon else None
        header = ["side", "step ms", "vs unsharded", *(["vs torch fully_shard + Muon"] if torch_sharded else []),
                  "MiB sent per rank per step", "vs AdamW training step", "max rel. update error"]
        rows = []
        for side in sides:
            ms = statistics.median(side.times)
            error = f"{max(side.errors):.2e}" if side.errors else "(reference)"
            rows.append([side.name, f"{1e3 * ms:.1f}", f"{ms / base:.3f}",
                         *([f"{ms / torch_sharded:.3f}"] if torch_sharded else []),
                         f"{side.sent_bytes / 2**20:.3f}", f"{side.sent_bytes / adamw_bytes:.3f}", error])
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        print()
        for row in [header, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        what = "Muon's" if torch_sharded else f"BlockPolarSGD's ({args.block_size} x {args.block_size} blocks)"
        caption = (f"{what} optimizer step on the {len(sides[0].params)} block matrices of a Llama (dim {args.dim}, "
                   f"{args.layers} blocks), {world_size} gloo ranks, median of {args.rounds} alternating steps; "
                   f"bytes against one AdamW training step of the whole model on fsdp_graph "
                   f"({adamw_bytes / 2**20:.3f} MiB per rank, batch {args.batch_size}x{args.seq_len}).")
        markdown.append((caption, header, rows))
    if args.markdown:
        print(f"markdown: {write_markdown(args.markdown, 'Muon on sharded parameters', markdown)}")


if __name__ == "__main__":
    main()
