"""An FSDP1-style training script, ported to fsdp_graph line for line.

    torchrun --nproc-per-node 2 examples/migrate_fsdp1.py --steps 20

Each FSDP1 idiom is kept as a comment above its replacement:
auto_wrap_policy -> wrap(model, ModuleWrapPolicy(...)); sharding_strategy -> strategy_kwargs;
sync_module_states -> load_full_state_dict from rank 0; model.no_sync() -> no_sync(model);
FSDP.summon_full_params -> summon_full_params; FULL_STATE_DICT -> full_state_dict.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llama import Block, Llama, LlamaConfig

from fsdp_graph.fsdp1.full_params import full_state_dict, load_full_state_dict, no_sync, summon_full_params
from fsdp_graph.fsdp1.wrap import ModuleWrapPolicy, strategy_kwargs, wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--strategy", default="FULL_SHARD", help="FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
    parser.add_argument("--save", default="", help="path for rank 0's full state dict (torch.save)")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    cfg = LlamaConfig(dim=64, num_layers=4, hidden_dim=172, max_seq_len=32)

    # FSDP1: pretrained weights on rank 0 only, the other ranks build the model on "meta", and
    #   FSDP(model, sync_module_states=True, param_init_fn=..., device_id=device) broadcasts them.
    torch.manual_seed(0)
    pretrained = Llama(cfg).state_dict() if rank == 0 else None
    with torch.device("meta"):
        model = Llama(cfg)
    # FSDP1: FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
    #             sharding_strategy=ShardingStrategy.FULL_SHARD)
    model, plan = wrap(model, ModuleWrapPolicy({Block}), **strategy_kwargs(args.strategy))
    model.to_empty(device=device)
    model.reset_buffers()  # FSDP1: param_init_fn; the rotary tables are not in the state dict
    load_full_state_dict(model, pretrained)
    if rank == 0:
        print(plan, flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        for micro in range(args.accumulate):
            tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=gen).to(device)
            tokens[:, 1:] = (tokens[:, :1] * 3 + torch.arange(1, 33, device=device)) % cfg.vocab_size
            # FSDP1: with model.no_sync(): ... on all but the last micro-batch
            sync = micro == args.accumulate - 1
            with no_sync(model) if not sync else contextlib.nullcontext():
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / args.accumulate
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {loss.item() * args.accumulate:.4f}", flush=True)

    # FSDP1: with FSDP.summon_full_params(model): inspect full weights
    with summon_full_params(model, writeback=False):
        norm = model.output.weight.norm().item()
    # FSDP1: FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(
    #            offload_to_cpu=True, rank0_only=True)); state = model.state_dict()
    state = full_state_dict(model, rank0_only=True, offload_to_cpu=True)
    if rank == 0:
        print(f"output.weight norm {norm:.4f}; full state dict: {len(state)} tensors, "
              f"{sum(v.numel() for v in state.values()):,} elements", flush=True)
        if args.save:
            torch.save(state, args.save)
    dist.barrier()
    if use_cuda:
        dist.destroy_process_group()
    else:
        sys.stdout.flush()
        os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


if __name__ == "__main__":
    main()
