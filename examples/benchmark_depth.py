"""Compile cost against depth: cold first step, warm relaunch, steady step and peak heap, per row and depth.

Each (row, depth) runs as its own launch of `torchrun --nproc-per-node 2 examples/benchmark_compile.py`
with one row, twice: first with an empty Inductor cache (the cold start), then with the cache the first
launch left (the relaunch a restarted job meets). One row per launch, so no row reuses kernels another
row compiled in the same process. The first step is timed in wall seconds of rank 0 from the row's
torch.compile call (which imports Inductor for FSDP2's row) to the step's end, which is what a user
waits: run it on a quiet machine. CPU seconds of rank 0 (the process and the compiler processes it
waited for, `TORCHINDUCTOR_COMPILE_THREADS=1`) are given beside them, but the two ranks share one cache
directory, so a rank that finds a kernel the other just built spends no CPU on it: one rank's CPU
seconds depend on which rank compiled first (FSDP2's blocks at 16 layers: 4.2 CPU s, 15.6 wall).
    python examples/benchmark_depth.py                                   # HF Llama at 4 and 16 layers
    python examples/benchmark_depth.py --layers 4,16 --markdown depth.md # the table for docs/benchmarks.md
    python examples/benchmark_depth.py --rows scheduled,fsdp2-compile --repeats 4   # medians of 4 launches each
Rows (benchmark_compile.py's names): `blocks` (our fully_shard, each block compiled on its own, the root
eager), `fsdp2-blocks` (the same with FSDP2), `fsdp2-compile` (FSDP2, torch.compile of the whole model) and
`scheduled` (ours, torch.compile(model, backend=fsdp_graph.backend(...)): the whole step, each block kind traced
once as a compile region, Inductor compiling each repeated piece between collectives once), `inline` (the same
with no regions, `regions="marked"`: every layer traced, the earlier default), `one-graph` (the same with `pieces=False`: Inductor compiles the step's
graphs whole), `regions`
(the same, the blocks marked as torch.compiler.nested_compile_region), `every-block` (the same regions made by
`fsdp_graph.backend(regions="blocks")`, no block marked: the default) and `block-scope` (ours,
torch.compile(model, backend=fsdp_graph.backend(scope="block")): the whole model compiled block by block).
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import parse_rows, run_two_ranks, write_markdown  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"blocks": "ours, blocks compiled one by one", "fsdp2-blocks": "FSDP2, blocks compiled one by one",
         "fsdp2-compile": "FSDP2, torch.compile(model)", "scheduled": "ours, whole step (fsdp_graph backend, in pieces)",
         "inline": "ours, whole step, no regions (regions=\"marked\")",
         "one-graph": "ours, whole step, Inductor on one graph (pieces=False)",
         "regions": "ours, whole step, blocks as nested_compile_region",
         "every-block": "ours, whole step, regions=\"blocks\" (no block marked)",
         "block-scope": "ours, torch.compile(model) with scope=\"block\""}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,16", help="comma-separated depths")
    parser.add_argument("--rows", default=",".join(NAMES), help=f"comma-separated rows, of {','.join(NAMES)}")
    parser.add_argument("--model", default="hf-llama", help="benchmark_compile.py's --model")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="steady steps timed per launch")
    parser.add_argument("--repeats", type=int, default=1,
                        help="launch every (depth, row) this many times, in turns, and report medians: a single "
                             "launch's cold start varies from one launch to the next (docs/benchmarks.md)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown, with date, machine and command")
    args = parser.parse_args()
    args.layers = [int(x) for x in args.layers.split(",")]
    args.rows = parse_rows(parser, args.rows, NAMES)
    return args


def launch(args, row: str, layers: int, cache_dir: str) -> dict:
    """One launch of benchmark_compile.py with one row; its JSON figures."""
    out = os.path.join(cache_dir, f"{row}.json")
    arguments = ["--model", args.model, "--dim", str(args.dim), "--seq-len", str(args.seq_len),
                 "--batch-size", str(args.batch_size), "--layers", str(layers), "--rows", row,
                 "--rounds", str(args.rounds), "--warmup", "2", "--json", out]
    (figures,) = run_two_ranks(os.path.join(HERE, "benchmark_compile.py"), arguments, out,
                               os.path.join(cache_dir, "inductor"), f"{row} at {layers} layers")
    return figures


def main() -> None:
    args = parse_args()
    # The first launch of a series pays for something that outlives an Inductor cache directory (in a
    # trial, FSDP2's blocks row took 23.7 CPU s at 1 layer, then 13.3 at 2): an untimed launch first.
    with tempfile.TemporaryDirectory() as cache_dir:
        launch(args, args.rows[0], min(args.layers), cache_dir)
    results: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
    for _ in range(args.repeats):  # in turns: a drift of the machine's speed reaches every row alike
        for layers in args.layers:
            for row in args.rows:
                with tempfile.TemporaryDirectory() as cache_dir:
                    cold = launch(args, row, layers, cache_dir)
                    warm = launch(args, row, layers, cache_dir)
                results.setdefault((row, layers), []).append((cold, warm))
                print(f"{NAMES[row]:40} {layers:3} layers: cold {cold['first_step_s']:6.1f} wall s "
                      f"({cold['first_step_cpu_s']:.1f} CPU), relaunch {warm['first_step_s']:6.1f} wall s, "
                      f"steady {warm['step_ms']:.1f} ms, peak {warm['peak_mib']} MiB", flush=True)

    def median(row: str, layers: int, launch_: int, field: str) -> float:
        """The median over the repeats of one figure of the cold (0) or warm (1) launch."""
        return statistics.median(runs[launch_][field] for runs in results[row, layers])

    def spread(row: str, layers: int) -> str:
        colds = [cold["first_step_s"] for cold, _ in results[row, layers]]
        return f" [{min(colds):.1f}-{max(colds):.1f}]" if len(colds) > 1 else ""

    low, high = min(args.layers), max(args.layers)
    header = ["row", "layers", "cold first step: wall s (CPU s)", "relaunch: wall s (CPU s)", "steady step ms",
              "peak heap MiB"]
    table = [[NAMES[row], layers,
              f"{median(row, layers, 0, 'first_step_s'):.1f} ({median(row, layers, 0, 'first_step_cpu_s'):.1f}){spread(row, layers)}",
              f"{median(row, layers, 1, 'first_step_s'):.1f} ({median(row, layers, 1, 'first_step_cpu_s'):.1f})",
              f"{median(row, layers, 1, 'step_ms'):.1f}", results[row, layers][-1][1]["peak_mib"]]
             for row, layers in results]
    if high > low:
        slope_header = ["row", f"cold wall s added per layer ({low} -> {high})", "cold wall s at 80 layers, extrapolated",
                        f"cold vs FSDP2 + compile at {high} layers", f"relaunch vs FSDP2 + compile at {high} layers"]
        has_reference = ("fsdp2-compile", high) in results
        slopes = []
        for row in args.rows:
            a, b = median(row, low, 0, "first_step_s"), median(row, high, 0, "first_step_s")
            per_layer = (b - a) / (high - low)
            cold_ratio = relaunch_ratio = ""
            if has_reference:
                cold_ratio = f"{b / median('fsdp2-compile', high, 0, 'first_step_s'):.2f}"
                relaunch_ratio = f"{median(row, high, 1, 'first_step_s') / median('fsdp2-compile', high, 1, 'first_step_s'):.2f}"
            slopes.append([NAMES[row], f"{per_layer:.2f}", f"{b + max(per_layer, 0.0) * (80 - high):.0f}", cold_ratio, relaunch_ratio])
        print("\n".join("  ".join(str(c) for c in line) for line in [slope_header, *slopes]))
    if args.markdown:
        caption = (f"{args.model}, dim {args.dim}, batch {args.batch_size}x{args.seq_len} per rank, 2 gloo ranks, one group "
                   f"per layer then the root; one launch per row and depth with an empty Inductor cache, then a relaunch "
                   f"with the cache it left. First steps in wall seconds of rank 0 on a quiet machine, its CPU seconds "
                   f"in brackets (`TORCHINDUCTOR_COMPILE_THREADS=1`; see the script's docstring for why they are not "
                   f"the measure); steady step: median of {args.rounds} steps of the relaunch, each row in its "
                   f"own launch (not alternated, so compare steady steps loosely)."
                   + (f" Every figure is the median of {args.repeats} launches made in turns, the cold first "
                      f"steps' range in square brackets." if args.repeats > 1 else ""))
        sections = [(caption, header, table)]
        if high > low:
            sections.append(("Per row, from the table above:", slope_header, slopes))
        print(f"markdown: {write_markdown(args.markdown, 'Compile cost against depth', sections)}")


if __name__ == "__main__":
    main()
