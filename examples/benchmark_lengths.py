"""Compile cost over variable sequence lengths: graphs compiled and seconds, ours against FSDP2 + compile.

Fine-tuning that pads each batch to its longest row sees a new sequence length at almost every step.
Each row runs in its own launch of 2 gloo ranks with an empty Inductor cache: an HF LlamaForCausalLM
(the `hf` extra) takes one training step per length, in the order given, and the launch reports the
graphs Dynamo compiled, the seconds of the first pass over the lengths (what a user waits) and of a
second pass (nothing left to compile), and the loss of each step.
    python examples/benchmark_lengths.py                                    # 4 layers, 8 lengths
    python examples/benchmark_lengths.py --lengths 24,32,40,48,56,64,72,80 --markdown lengths.md
    python examples/benchmark_lengths.py --per-rank                         # each rank its own lengths
Rows: `fsdp2-compile` (torch's fully_shard, torch.compile(model) with Inductor) and `scheduled` (ours,
torch.compile(model, backend="fsdp_graph"): the whole step, Inductor compiling it in pieces), `one-graph` (the
same with `fsdp_graph.backend(pieces=False)`: Inductor compiles the step's graphs whole), `every-block` (the
same, `fsdp_graph.backend(regions="blocks")`: the decoder layers as compile regions, the default, so
the same as `scheduled`) and `inline` (`regions="marked"`: no regions, the earlier default). `--per-rank` gives rank r the
lengths shifted by r places, as when each rank pads to its own longest row.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_report import parse_rows, run_two_ranks, write_markdown  # noqa: E402

NAMES = {"fsdp2-compile": "FSDP2, torch.compile(model)", "scheduled": "ours, whole step (fsdp_graph backend, in pieces)",
         "every-block": "ours, whole step, regions=\"blocks\"",
         "inline": "ours, whole step, no regions (regions=\"marked\")",
         "one-graph": "ours, whole step, Inductor on one graph (pieces=False)"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="24,32,40,48,56,64,72,80", help="comma-separated sequence lengths")
    parser.add_argument("--rows", default=",".join(NAMES), help=f"comma-separated rows, of {','.join(NAMES)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--compiler", default="inductor", help="our row's compiler: inductor or aot_eager")
    parser.add_argument("--dynamic", choices=("auto", "true"), default="auto",
                        help="torch.compile's dynamic: auto (None, the default) or true")
    parser.add_argument("--per-rank", action="store_true", help="each rank its own length at each step")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown, with date, machine and command")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one row, inside torchrun
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.rows = parse_rows(parser, args.rows, NAMES)
    return args


def worker(args) -> None:
    """One row on this rank: a step per length, twice over; figures as JSON from rank 0."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp_graph

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if args.worker == "fsdp2-compile":
        from torch.distributed.fsdp import fully_shard
        backend = "inductor"
    else:
        fully_shard = fsdp_graph.fully_shard
        regions = {"every-block": {"regions": "blocks"}, "inline": {"regions": "marked"}}.get(args.worker, {})
        backend = fsdp_graph.backend(compiler=args.compiler, pieces=args.worker != "one-graph", **regions)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(args.lengths) + 1, use_cache=False))
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    dist.barrier()
    start = time.perf_counter()  # the first pass counts from torch.compile, which imports Inductor for FSDP2's row
    run = torch.compile(model, backend=backend, dynamic=True if args.dynamic == "true" else None)
    compile_call_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = args.lengths[rank:] + args.lengths[:rank] if args.per_rank else args.lengths
    torch._dynamo.utils.counters.clear()
    passes, losses = [], []
    for _ in range(2):
        dist.barrier()
        start = time.perf_counter()
        for step, length in enumerate(lengths):
            tokens = torch.randint(0, 256, (args.batch_size, length + 1), generator=torch.Generator().manual_seed(step))
            logits = run(tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        dist.barrier()
        passes.append(time.perf_counter() - start + (compile_call_s if not passes else 0.0))
    stats = torch._dynamo.utils.counters["stats"]
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"row": args.worker, "graphs": stats["unique_graphs"], "ops_captured": stats["calls_captured"],
                       "first_pass_s": passes[0], "second_pass_s": passes[1], "losses": losses}, f)
    dist.destroy_process_group()


def launch(args, row: str, cache_dir: str) -> dict:
    out = os.path.join(cache_dir, f"{row}.json")
    arguments = ["--worker", row, "--json", out, "--lengths", ",".join(map(str, args.lengths)), "--layers", str(args.layers),
                 "--dim", str(args.dim), "--batch-size", str(args.batch_size), "--compiler", args.compiler,
                 "--dynamic", args.dynamic] + (["--per-rank"] if args.per_rank else [])
    return run_two_ranks(os.path.abspath(__file__), arguments, out, os.path.join(cache_dir, f"inductor-{row}"), row)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for row in args.rows:
            rows.append(launch(args, row, cache_dir))
            print(json.dumps(rows[-1]), flush=True)
    reference = next((r for r in rows if r["row"] == "fsdp2-compile"), None)
    header = ["row", "graphs", "ops captured", "first pass s", "vs FSDP2 + compile", "second pass s"]
    table = []
    for r in rows:
        ratio = f"{r['first_pass_s'] / reference['first_pass_s']:.2f}" if reference else "n/a"
        table.append([NAMES[r["row"]], str(r["graphs"]), str(r["ops_captured"]), f"{r['first_pass_s']:.1f}", ratio,
                      f"{r['second_pass_s']:.1f}"])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for line in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    if args.markdown:
        title = (f"Variable sequence lengths ({','.join(map(str, args.lengths))}{', each rank its own' if args.per_rank else ''}), "
                 f"HF Llama {args.layers} layers, dim {args.dim}, batch {args.batch_size}, dynamic={args.dynamic}")
        write_markdown(args.markdown, title, [("", header, table)])


if __name__ == "__main__":
    main()
