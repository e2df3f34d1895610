import torch
from _harness import run_ranks
import test_compile_rank_divergence as t

def _f(rank, world_size, layers, lengths, opts):
    torch._dynamo.config.recompile_limit = 1 if rank == 1 else 8
    return t._one_rank_stays_on_the_first_graph(rank, world_size, layers, lengths, opts, True)

def test_budget():
    print(run_ranks(_f, 2, 4, ([24, 24, 24], [24, 64, 128]), {"memory_budget_bytes": int(7.5 * 2**20)}, timeout_s=200))

def test_bucketed():
    print(run_ranks(_f, 2, 4, ([24, 24, 24], [24, 32, 40]), {"bucket_cap_mb": 100}, timeout_s=200))
