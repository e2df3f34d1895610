"""Compile cost on a model we did not write: torchtitan's Trainer and its llama3 debug model, on 2 gloo ranks.

Each row runs as its own `torchrun --nproc-per-node 2` launch of this script, twice: first with an empty
Inductor cache (the cold start), then with the cache the first launch left (the relaunch). The trainer is
torchtitan's own (its data loader, chunked loss, selective activation checkpointing, AdamW), built from
`llama3_debugmodel()` with the CPU stand-ins of examples/torchtitan_on_cpu.py, fp32:
    python examples/benchmark_torchtitan.py                                   # every row, 6 layers
    python examples/benchmark_torchtitan.py --rows fsdp2-compile,scheduled --markdown titan.md
Rows: `fsdp2-compile` (torch's fully_shard, `model.compile()` of the whole model, Inductor),
`fsdp2-blocks` (torch's fully_shard, torchtitan's `compile.enable`: each block and the loss compiled on
their own, torchtitan's default way) and `scheduled` (fsdp_graph's fully_shard through
`fsdp_graph.use_in_place_of_torch_fsdp()`, `model.compile(backend="fsdp_graph")`: the whole step) and
`every-block` (the same with `fsdp_graph.backend(regions="blocks")`: each block kind traced once, the default,
so the same as `scheduled`) and `inline` (`regions="marked"`: no regions, the earlier default).
torchtitan's users compile its way (each block on its own), so the whole step is held against both
FSDP2 rows. `--ac none` turns torchtitan's selective activation checkpointing (its default) off;
`--ac selective-hashed` keeps it and gives each block's checkpoint `context_fn` the `cache_hash` torch asks
of a user who wants AOTAutogradCache to serve a graph with selective checkpointing (without one, torch
bypasses that cache for the graph: a relaunch traces it again), as a torchtitan user could set it.
Inductor is imported before the clock starts in every row; the first step is rank 0's wall seconds from
the compile call (torchtitan's blocks row: from the start of training, its compile calls being made in
the build) to the end of the step, what a user waits. The cold launch's second step is shown too:
torchtitan's chunked loss turns reshard_after_forward on for its head group (norm, lm_head) at the end of
every step, where it was off before the first, and a whole-step graph holds that choice, so it compiles
again at the second step (FSDP2's eager hooks read it at every step). Run it on a quiet machine.
`--model qwen3_moe_debug` or `--model deepseek_v3_debugmodel` trains one of torchtitan's MoE debug models
with `--ep` expert parallelism over the 2 ranks (the expert weights on the expert-parallel mesh, given
to `fully_shard` with their own sharding mesh, docs/frameworks/torchtitan.md), and the eager rows
`fsdp2-eager` and `eager` (ours) join the compiled ones:
    python examples/benchmark_torchtitan.py --model qwen3_moe_debug --ep 2 --rows fsdp2-eager,eager,fsdp2-compile,scheduled
`--capture-scalars` sets `torch._dynamo.config.capture_scalar_outputs` for the compiled rows: the token
dispatcher's all-to-all splits (a `.tolist()` of routing counts) are then traced as numbers of the graph
instead of breaking it at every MoE layer, so the all-to-alls and the expert groups' collectives are in
the step's graph. With torchtitan's selective checkpointing on, FSDP2's compile then fails in torch
(docs/frameworks/torchtitan.md): use it with `--ac none`.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import parse_rows, run_two_ranks, write_markdown  # noqa: E402

HERE = os.path.abspath(__file__)
NAMES = {"fsdp2-eager": "FSDP2, eager",
         "eager": "ours, eager",
         "fsdp2-compile": "FSDP2, model.compile() (whole model)",
         "fsdp2-blocks": "FSDP2, torchtitan's compile.enable (blocks and loss)",
         "scheduled": "ours, model.compile(backend=\"fsdp_graph\") (whole step)",
         "every-block": "ours, the same with fsdp_graph.backend(regions=\"blocks\")",
         "inline": "ours, the same with no regions (regions=\"marked\")"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(NAMES), help=f"comma-separated rows, of {','.join(NAMES)}")
    parser.add_argument("--layers", type=int, default=6, help="the debug model's first LAYERS layers (it has 6)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per rank per step (batch 1)")
    parser.add_argument("--ac", choices=("selective", "selective-hashed", "none"), default="selective",
                        help="torchtitan's activation checkpointing: its default (selective, per op), the same with a "
                             "cache_hash on its context_fn, or none")
    parser.add_argument("--model", choices=("llama3_debugmodel", "qwen3_moe_debug", "deepseek_v3_debugmodel"),
                        default="llama3_debugmodel", help="torchtitan's debug model; the MoE ones take --ep")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel degree of an MoE model (1 or 2)")
    parser.add_argument("--capture-scalars", action="store_true",
                        help="compiled rows trace the token dispatcher's splits (capture_scalar_outputs): no graph break")
    parser.add_argument("--rounds", type=int, default=3, help="steady steps timed per launch, after 2 warm-up steps")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown, with date, machine and command")
    parser.add_argument("--worker", metavar="ROW", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        args.rows = parse_rows(parser, args.rows, NAMES)
    if args.ep not in (1, 2) or (args.ep > 1 and args.model == "llama3_debugmodel"):
        parser.error("--ep 2 needs an MoE --model; --ep is 1 or 2 on 2 ranks")
    return args


def worker(args) -> None:
    """One row under torchrun: build torchtitan's trainer, train, and have rank 0 write its figures."""
    import torch

    row = args.worker
    ours = row in ("eager", "scheduled", "every-block", "inline")
    if ours:
        import fsdp_graph

        fsdp_graph.use_in_place_of_torch_fsdp()
    import torchtitan_on_cpu

    torchtitan_on_cpu.prepare()
    import torch._inductor.compile_fx  # noqa: F401  every row's clock starts with Inductor imported

    rank = int(os.environ["RANK"])
    assets, sizes = tempfile.mkdtemp(prefix="titan-assets-"), dict(seq_len=args.seq_len, batch=1, steps=3 + args.rounds)
    if args.model == "llama3_debugmodel":
        config = torchtitan_on_cpu.debug_config(assets, layers=args.layers, spmd_backend="partial_dtensor", **sizes)
    else:
        config = torchtitan_on_cpu.moe_debug_config(args.model, assets, layers=args.layers, expert_parallel_degree=args.ep,
                                                    data_parallel_shard_degree=2, **sizes)
    config.metrics.log_freq = 1000
    config.compile.enable = row == "fsdp2-blocks"
    if args.ac == "none":
        config.activation_checkpoint = None
    trainer = config.build()
    if args.ac == "selective-hashed":
        give_checkpoint_policies_a_hash(trainer.model_parts[0])
    if not ours:
        torchtitan_on_cpu.sum_reductions_for_gloo(trainer.model_parts[0])

    step_ends = []
    train_step = trainer.train_step

    def timed_step(*a, **k):
        train_step(*a, **k)
        step_ends.append(time.perf_counter())

    losses = torchtitan_on_cpu.record_losses(trainer)
    trainer.train_step = timed_step
    if args.capture_scalars:
        torch._dynamo.config.capture_scalar_outputs = True
    start = time.perf_counter()
    if row == "fsdp2-compile":
        trainer.model_parts[0].compile()
    elif row == "scheduled":
        trainer.model_parts[0].compile(backend="fsdp_graph")
    elif row == "every-block":
        trainer.model_parts[0].compile(backend=fsdp_graph.backend(regions="blocks"))  # imported above, as `ours`
    elif row == "inline":
        trainer.model_parts[0].compile(backend=fsdp_graph.backend(regions="marked"))
    trainer.train()
    if rank == 0:
        steps = [b - a for a, b in zip(step_ends[2:], step_ends[3:])]
        with open(args.json, "w") as f:
            json.dump({"first_step_s": step_ends[0] - start, "step_ms": 1e3 * statistics.median(steps),
                       "steps_s": [b - a for a, b in zip([start, *step_ends], step_ends)], "losses": losses}, f)
    torch.distributed.destroy_process_group()


def give_checkpoint_policies_a_hash(model) -> None:
    """Give every checkpointed block's `context_fn` a `cache_hash`, as torch asks of a user whose graph
    holds selective activation checkpointing and who wants AOTAutogradCache to serve it. torchtitan's
    policy is its code (save the ops of its save list, all but every second matmul) over that list:
    the hash covers torchtitan's version, the module's source and the list, so a change to either
    misses the cache."""
    import hashlib
    import inspect

    import torchtitan
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.distributed import activation_checkpoint

    policy = hashlib.sha256(repr((
        torchtitan.__version__, sorted(op.name() for op in activation_checkpoint._get_default_save_ops()),
        inspect.getsource(activation_checkpoint),
    )).encode()).hexdigest()
    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            module.checkpoint_fn.keywords["context_fn"].cache_hash = f"torchtitan-selective-ac:{policy}"


def launch(args, row: str, cache_dir: str) -> dict:
    """One launch of this script's worker with one row; its JSON figures."""
    out = os.path.join(cache_dir, f"{row}.json")
    arguments = ["--worker", row, "--json", out, "--layers", str(args.layers), "--seq-len", str(args.seq_len),
                 "--rounds", str(args.rounds), "--ac", args.ac, "--model", args.model, "--ep", str(args.ep)]
    if args.capture_scalars:
        arguments.append("--capture-scalars")
    return run_two_ranks(HERE, arguments, out, os.path.join(cache_dir, "inductor"), row)


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    # The first launch of a series pays for something that outlives an Inductor cache directory
    # (examples/benchmark_depth.py): an untimed one first.
    with tempfile.TemporaryDirectory() as cache_dir:
        launch(args, args.rows[0], cache_dir)
    results = {}
    for row in args.rows:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = launch(args, row, cache_dir)
            warm = launch(args, row, cache_dir)
        results[row] = cold, warm
        print(f"{NAMES[row]:55} cold {cold['first_step_s']:6.1f} s (second step {cold['steps_s'][1]:.1f} s), "
              f"relaunch {warm['first_step_s']:6.1f} s, "
              f"steady {warm['step_ms']:.1f} ms, losses {' '.join(f'{x:.4f}' for x in warm['losses'])}", flush=True)
    # FSDP2 + compile as torch's examples do it and as torchtitan does: the step is held against both
    # (and against FSDP2 eager where it ran)
    references = [r for r in ("fsdp2-eager", "fsdp2-compile", "fsdp2-blocks") if r in results]
    figures = {"cold": lambda cold, warm: cold["first_step_s"], "relaunch": lambda cold, warm: warm["first_step_s"],
               "steady": lambda cold, warm: warm["step_ms"]}
    header = ["row", "cold first step s", "cold second step s", "relaunch first step s", "steady step ms"]
    header += [f"{what} vs {NAMES[r].split(' (')[0]}" for r in references for what in figures]
    header.append("losses (relaunch)")
    table = []
    for row, (cold, warm) in results.items():
        ratios = [f"{figure(cold, warm) / figure(*results[r]):.2f}" for r in references for figure in figures.values()]
        table.append([NAMES[row], f"{cold['first_step_s']:.1f}", f"{cold['steps_s'][1]:.1f}", f"{warm['first_step_s']:.1f}",
                      f"{warm['step_ms']:.1f}",
                      *ratios, " ".join(f"{x:.4f}" for x in warm["losses"])])
    print("\n".join("  ".join(str(c) for c in line) for line in [header, *table]))
    if args.markdown:
        parallel = f", expert parallel {args.ep}" if args.ep > 1 else ""
        caption = (f"torchtitan 0.3.0 {args.model}, {args.layers} layers{parallel}, 1x{args.seq_len} tokens per rank, fp32, "
                   f"activation checkpointing {args.ac}, "
                   + ("the dispatcher's splits traced (capture_scalar_outputs), " if args.capture_scalars else "")
                   + f"2 gloo ranks; one launch per row with an empty Inductor cache, then a relaunch with the cache it "
                   f"left; first steps in wall seconds of rank 0, steady step the median of {args.rounds} steps of the "
                   f"relaunch.")
        print(f"markdown: {write_markdown(args.markdown, 'Compile cost on torchtitan', [(caption, header, table)])}")


if __name__ == "__main__":
    main()
