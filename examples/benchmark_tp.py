"""Benchmark FSDP composed with tensor parallelism: fsdp_graph against torch's fully_shard.

CPU / gloo, 4 ranks as a (dp=2, tp=2) mesh, the example Llama with the usual tensor-parallel plan
(attention's wq/wk/wv and the MLP's w1/w3 column-wise, wo and w2 row-wise), then `fully_shard` over
dp per block and on the root:
    torchrun --nproc-per-node 4 examples/benchmark_tp.py
    torchrun --nproc-per-node 4 examples/benchmark_tp.py --dim 128 --layers 2 --rounds 4   # quicker
    torchrun --nproc-per-node 4 examples/benchmark_tp.py --layers 4 --rounds 6 --markdown tp.md   # table for docs/benchmarks.md
    python examples/benchmark_tp.py --predict-70b     # one process: the Llama-3-70B prediction only

Rows: fsdp_graph eager, torch's fully_shard eager, and each compiled (fsdp_graph's backend; torch's
with Inductor). Steps alternate between the rows. Per row: median step time, ratio to torch's eager
composition, peak heap of one step (glibc's in-use bytes, sampled; max over ranks) and collectives
per step (gloo's profiler events). This is a benchmark, not a test: it asserts nothing.

`--predict-70b` traces a Llama-3-70B-shaped model (80 layers, dim 8192, 64 heads, 8 key/value
heads, bf16 parameters, fp32 reduction, activation checkpointing per block) composed as FSDP 8 x TP 8
on the fake process group of 64 ranks with meta tensors, schedules it with the backend's passes and
simulates a step: TP's collectives on `h100-nvlink` (inside a node), FSDP's on `h100-infiniband`
(across nodes), each on its own stream. The backward graph recomputes each block's forward (its
all-gather and TP all-reduces included), and the simulator counts that time. Rows: unscheduled, the
scheduling passes without async TP, with it (`--predict-chunks` row chunks), and with
`overlap_tp_all_reduces` too. Each prints the
step, the exposed communication with FSDP's and TP's shares, and the peak of one rank: fp32
parameter shards, gradients and AdamW moments, plus the larger of the forward's peak and the
backward's (saved block inputs counted until their last use).
    python examples/benchmark_tp.py --predict-70b --predict-layers 4    # a dry run in about a minute
    python examples/benchmark_tp.py --predict-70b --markdown tp70b.md     # table for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_compile import Row  # noqa: E402
from bench_report import write_markdown  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

import fsdp_graph  # noqa: E402

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per row")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown, with date, machine and command")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row (the first compiles)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--predict-70b", action="store_true", help="only the Llama-3-70B FSDP 8 x TP 8 prediction, one process")
    parser.add_argument("--predict-batch", type=int, default=4, help="sequences per dp rank in the prediction")
    parser.add_argument("--predict-seq-len", type=int, default=8192, help="tokens per sequence in the prediction")
    parser.add_argument("--predict-layers", type=int, default=80, help="blocks in the prediction (fewer: a quick dry run)")
    parser.add_argument("--predict-chunks", type=int, default=8, help="async TP: row chunks per matmul -> all-reduce")
    parser.add_argument("--predict-async-only", action="store_true", help="only the last row, all passes (skips the slower baselines)")
    parser.add_argument("--predict-no-checkpoint", action="store_true", help="predict without activation checkpointing")
    parser.add_argument("--predict-trace-all", action="store_true",
                        help="trace every block (default: trace four and stamp the rest out, passes/stamp.py)")
    return parser.parse_args()


# Vocabulary-parallel embedding and output head, as torchtitan's Llama 3 plan: the embedding's rows
# (tokens) and the head's columns (logits) split over tp. The head's output stays sharded by vocabulary
# (`loss_parallel` computes the cross-entropy on those shards with [batch, seq]-sized all-reduces).
ROOT_PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
    "output": ColwiseParallel(output_layouts=Shard(-1)),
}


def parallelize_llama(llama: Llama, mesh, fully_shard, vocab_parallel: bool = False, **kwargs) -> Llama:
    """Tensor parallel over mesh["tp"] per block (and with `vocab_parallel` on the embedding and
    output head, `ROOT_PLAN`), then fully_shard over mesh["dp"]: blocks first; with `vocab_parallel`
    the embedding and [norm, output] as groups of their own, so that the head's all-gather can be
    prefetched and its reduce-scatter overlaps the backward (torchtitan's grouping)."""
    for block in llama.layers:
        parallelize_module(block, mesh["tp"], BLOCK_PLAN)
        fully_shard(block, mesh=mesh["dp"], **kwargs)
    if vocab_parallel:
        parallelize_module(llama, mesh["tp"], ROOT_PLAN)
        fully_shard(llama.tok_embeddings, mesh=mesh["dp"], **kwargs)
        fully_shard([llama.norm, llama.output], mesh=mesh["dp"], **kwargs)
    return fully_shard(llama, mesh=mesh["dp"], **kwargs)


def main() -> None:
    args = arguments
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise ValueError("run with torchrun --nproc-per-node 4: a (dp=2, tp=2) mesh")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cfg = LlamaConfig(vocab_size=256, dim=args.dim, num_layers=args.layers, num_heads=4,
                      hidden_dim=args.dim * 11 // 4, max_seq_len=args.seq_len + 1)

    def model(fully_shard):
        torch.manual_seed(0)
        return parallelize_llama(Llama(cfg), mesh, fully_shard)

    rows = [
        Row("fsdp_graph eager", model(fsdp_graph.fully_shard)),
        Row("torch eager", model(torch_fully_shard)),
        Row("fsdp_graph compiled", model(fsdp_graph.fully_shard), "fsdp_graph"),
        Row("torch + compile", model(torch_fully_shard), "inductor"),
    ]
    # The ranks of one tp group see the same batch; the dp groups each their own.
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]
    working = []
    for row in rows:
        try:
            for i in range(args.warmup):
                row.step(batches[i % len(batches)])
            working.append(row)
        except Exception as error:
            if rank == 0:
                print(f"{row.name}: failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
    for i in range(args.rounds):
        for row in working if i % 2 == 0 else reversed(working):  # alternate who goes first
            row.timed_step(batches[i % len(batches)])
    for row in working:
        row.measure(batches[0])
    if rank == 0:
        reference = statistics.median(next(r for r in working if r.name == "torch eager").times)
        print(f"{'':22}{'step ms':>10}{'vs torch eager':>16}{'peak MiB':>11}  collectives per step")
        for row in working:
            median = statistics.median(row.times)
            print(f"{row.name:22}{median * 1e3:>10.1f}{median / reference:>16.3f}{row.peak:>11}  {row.collectives}")
        if args.markdown:
            header = ["row", "step ms", "vs torch eager", "peak heap MiB", "collectives per step"]
            table = [[row.name, f"{statistics.median(row.times) * 1e3:.1f}",
                      f"{statistics.median(row.times) / reference:.3f}", row.peak, row.collectives] for row in working]
            caption = (f"Llama {args.layers} blocks, dim {args.dim}, {dist.get_world_size()} gloo ranks (dp x tp), "
                       f"median of {args.rounds} alternating steps.")
            print(f"markdown: {write_markdown(args.markdown, 'FSDP + tensor parallel', [(caption, header, table)])}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13's gloo teardown can abort (docs/reliability.md, Known limits)


def predict_70b(args) -> None:
    import copy
    import time

    from fsdp_graph.predict import capture_graphs, fake_world, predict_step, schedule_graphs

    from fsdp_graph.passes.cost_model import CostModel

    cost_model = CostModel("h100-infiniband", links={"tp": "h100-nvlink"})
    cfg = LlamaConfig(vocab_size=128256, dim=8192, num_layers=args.predict_layers, num_heads=64, num_kv_heads=8,
                      hidden_dim=28672, max_seq_len=args.predict_seq_len, checkpoint_blocks=not args.predict_no_checkpoint,
                      flash_attention=True)
    with fake_world(64):
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Llama(cfg)
        num_params = sum(p.numel() for p in model.parameters())
        policy = fsdp_graph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        parallelize_llama(model, mesh, fsdp_graph.fully_shard, vocab_parallel=True, mp_policy=policy)
        # Lives through the step outside the graphs: fp32 parameter shards, their gradients, AdamW's two moments.
        resident = 4 * sum(p.to_local().numel() for p in model.parameters()) * 4
        start = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (args.predict_batch, args.predict_seq_len), device="meta")
        graphs = capture_graphs(model, tokens, repeated_blocks=None if args.predict_trace_all else model.layers)
        traced = "every block traced" if args.predict_trace_all else "four blocks traced, the rest stamped out"
        ac = "no activation checkpointing" if args.predict_no_checkpoint else "activation checkpointing per block"
        setup = (f"Llama-3-70B shape, {cfg.num_layers} layers ({num_params / 1e9:.2f}B params), FSDP 8 x TP 8 (64 ranks, "
                 f"vocabulary-parallel embedding and head), {args.predict_batch}x{args.predict_seq_len} tokens per dp rank, "
                 f"bf16 params, fp32 reduce, flash attention, {ac}; {cost_model}; {traced}; resident per rank (fp32 shards, "
                 f"gradients, AdamW moments) {resident / 2**30:.2f} GiB")
        print(f"{setup}; traced in {time.perf_counter() - start:.0f} s")

        def scheduled(disabled):
            return schedule_graphs(graphs, hardware_profile=cost_model, disabled_passes=disabled,
                                   async_tp_chunks=args.predict_chunks)

        rows = (("unscheduled", lambda: graphs),
                ("fsdp_graph, async TP off", lambda: scheduled({"async_tp", "overlap_tp_all_reduces"})),
                (f"fsdp_graph, async TP {args.predict_chunks} chunks", lambda: scheduled({"overlap_tp_all_reduces"})),
                (f"fsdp_graph, async TP {args.predict_chunks} chunks + overlap_tp_all_reduces", lambda: scheduled(set())))
        table = []
        for name, schedule in rows[-1:] if args.predict_async_only else rows:
            start = time.perf_counter()
            step = predict_step(schedule(), cost_model, resident)
            for kind, sim in step.simulations.items():
                print(f"  {name:30} {kind:9} {sim.total_s * 1e3:8.1f} ms  exposed {sim.exposed_comm_s * 1e3:7.2f} ms "
                      f"({100 * sim.exposed_fraction:5.2f}%)")
            per = ", ".join(f"{p} {step.num_collectives[p]} collectives {step.comm_s[p] * 1e3:.1f} ms "
                            f"({100 * (1 - step.exposed_s_by[p] / step.comm_s[p]):.0f}% hidden)" for p in sorted(step.comm_s))
            shares = ", ".join(f"{p} {100 * step.share(p):.2f}%" for p in sorted(step.comm_s))
            print(f"{name:32} step {step.step_s * 1e3:8.1f} ms, exposed comm {step.exposed_s * 1e3:7.2f} ms = "
                  f"{100 * step.share():.2f}% of the step ({shares}); peak {step.peak_bytes / 2**30:.2f} GiB per rank "
                  f"({step.peak_graph}){' > 80 GiB' if step.peak_bytes > 80 * 2**30 else ''}; {per} "
                  f"[{time.perf_counter() - start:.0f} s]")
            table.append([name, f"{step.step_s * 1e3:.1f}", f"{step.exposed_s * 1e3:.1f} ms = {100 * step.share():.2f}%",
                          f"{100 * step.share('fsdp'):.2f}%", f"{100 * step.share('tp'):.2f}%",
                          f"{step.num_collectives.get('tp', 0)} ({100 * (1 - step.exposed_s_by['tp'] / step.comm_s['tp']):.0f}%)",
                          f"{step.peak_bytes / 2**30:.2f} GiB ({step.peak_graph})"])
    if args.markdown:
        header = ["schedule", "step ms", "exposed communication", "FSDP's share", "TP's share",
                  "TP collectives (hidden)", "peak per rank"]
        print(f"markdown: {write_markdown(args.markdown, 'Predicted, Llama-3-70B shape, FSDP 8 x TP 8', [(setup + '.', header, table)])}")


if __name__ == "__main__":
    arguments = parse_args()
    predict_70b(arguments) if arguments.predict_70b else main()
