"""A block-wise preconditioned optimizer on fsdp_graph's whole-matrix hook, and the placement that
keeps its blocks whole on every rank.

CPU / gloo (prints the loss and the bytes the optimizer sent, with and without the placement):
    torchrun --nproc-per-node 2 examples/block_polar.py --steps 20
    torchrun --nproc-per-node 2 examples/block_polar.py --steps 20 --placement shard0

`BlockPolarSGD` cuts every matrix into b x b blocks (the last ones along a dim shorter) and replaces
each block B of the momentum by its polar factor (B B^T + eps I)^(-1/2) B: a block-diagonal
preconditioner, Shampoo's left factor taken from the block itself. Each block's update needs that
whole block, not the whole matrix, so it declares its blocks through `independent_block`. Under
`whole_block_placement((b, b), mesh)` every rank holds whole blocks of every matrix and updates them
where they lie: no bytes sent. Under `Shard(0)` alone, a cut between ranks that falls inside a row of
blocks sends that row of blocks to an owner and its update back (docs/optim.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llama import Llama, llama_config, shard_llama
from train_llama import synthetic_batch

from fsdp_graph import fully_shard
from fsdp_graph.optim import WholeMatrixOptimizer, local, whole_block_placement


def block_polar(matrix: torch.Tensor, block_size: int, eps: float) -> torch.Tensor:
    """Each b x b block B of `matrix` ([..., M, N]) replaced by (B B^T + eps I)^(-1/2) B, in float64.

    The matrix is padded with zeros to whole blocks first: a zero-padded block gives the same result
    on its real rows and columns and zeros elsewhere, so all blocks go through one batched `eigh`.
    """
    b = block_size
    *lead, m, n = matrix.shape
    rows, cols = -(-m // b), -(-n // b)
    x = F.pad(matrix.to(torch.float64), (0, cols * b - n, 0, rows * b - m))
    blocks = x.reshape(*lead, rows, b, cols, b).transpose(-3, -2)  # [..., rows, cols, b, b]
    gram = blocks @ blocks.mT + eps * torch.eye(b, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(gram)
    inv_sqrt = (vectors * values.rsqrt().unsqueeze(-2)) @ vectors.mT
    out = (inv_sqrt @ blocks).transpose(-3, -2).reshape(*lead, rows * b, cols * b)
    return out[..., :m, :n].to(matrix.dtype)


class BlockPolarSGD(WholeMatrixOptimizer):
    """SGD with momentum whose update is the block-wise polar factor of the momentum (b x b blocks).

    Args: lr, momentum (buffer <- momentum * buffer + grad), block_size (b), eps.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9, block_size: int = 32, eps: float = 1e-8):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int; got {block_size!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, block_size=block_size, eps=eps))

    def check_param(self, param: torch.Tensor) -> None:
        if param.ndim < 2:
            raise ValueError(
                f"BlockPolarSGD updates matrices; got a parameter of shape {tuple(param.shape)}: use AdamW for it"
            )

    def independent_block(self, group: dict, shape: torch.Size) -> tuple[int, ...]:
        return (1,) * (len(shape) - 2) + (group["block_size"], group["block_size"])

    def matrix_cost(self, group: dict, shape: torch.Size) -> float:
        return float(shape.numel() * group["block_size"])  # per block: b^3 for b^2 entries

    def prepare(self, group: dict, param: torch.Tensor, state: dict) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)  # a DTensor sharded like the parameter
        buf = local(state["momentum_buffer"])
        buf.mul_(group["momentum"]).add_(local(param.grad))
        return buf

    def whole_matrix_update(self, group: dict, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        return [block_polar(m, group["block_size"], group["eps"]) for m in matrices]

    def apply_update(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        local(param).add_(update, alpha=-group["lr"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.005, help="BlockPolarSGD's (AdamW: 3e-3)")
    parser.add_argument("--placement", choices=["whole-blocks", "shard0"], default="whole-blocks",
                        help="whole_block_placement, or fully_shard's default Shard(0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = llama_config(args.dim, args.layers, 32)
    placement = whole_block_placement((args.block_size, args.block_size), world_size)
    shard_kwargs = {"shard_placement_fn": placement} if args.placement == "whole-blocks" else {}
    model = shard_llama(Llama(cfg), fully_shard, **shard_kwargs)
    matrices = [p for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    optimizers = [BlockPolarSGD(matrices, lr=args.lr, block_size=args.block_size), torch.optim.AdamW(others, lr=3e-3)]
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = synthetic_batch(cfg, 4 * world_size, 32, gen, "cpu").chunk(world_size)[rank]
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}, BlockPolarSGD sent {optimizers[0].last_step_sent_bytes} bytes "
                  f"({args.placement})", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


if __name__ == "__main__":
    main()
