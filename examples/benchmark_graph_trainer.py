"""Against torchtitan's graph_trainer on its own model, with the loss inside every compiled graph.

torchtitan 0.3.0's llama3 debug model with SDPA attention (FlexAttention, its default, has no backward
on the CPU; graph_trainer builds SDPA language models for its own tests, `build_decoder_config_for_backend`),
2 gloo ranks, `--seq` tokens per rank, fp32, the same initial weights (built once from one seed and
loaded into every row), the same batches, AdamW (foreach) at one learning rate, and the same steps
for every row. Each row is its own pair of `torchrun --nproc-per-node 2` launches of this script: the
first with an empty Inductor cache (the cold first step), the second with the cache the first left
(the relaunch). The loss is in the compiled graph of every row:
  - `gt-full`, `gt-regional`: torchtitan's GraphTrainer (`experiments/graph_trainer`) through its own
    `forward_backward_step`: one make_fx trace of forward + loss + backward, its default pass pipeline
    (unshard dedup, its graph-level activation checkpointing, one bucket per block with prefetch),
    then full Inductor, or regional Inductor (its default);
  - `ours`: a module computing the loss from (tokens, labels) is the `fsdp_graph.fully_shard` root
    (each block a group of its own) and is what `torch.compile(root, backend="fsdp_graph")` compiles.
    `--groups torchtitan` makes the groups of torchtitan's own FSDP recipe (`apply_fsdp`) instead:
    the embedding, each block, the final norm with the output layer (kept unsharded until backward),
    then the root; these are the buckets graph_trainer makes (embedding, each block, norm + output);
  - `ours-budget`: the same with `fsdp_graph.backend(memory_budget_bytes=...)`, which keeps the groups
    that fit unsharded from forward to backward (selective unsharding, docs/compiler.md);
  - `ours-fast`: the same with `fsdp_graph.backend(compiler="aot_eager")`: our passes schedule the
    step's graph, which then runs op by op (no kernels compiled), as graph_trainer's regional mode runs
    everything outside its regions;
  - `ours-ac`: the same with `fsdp_graph.backend(activation_checkpointing="save_matmuls")`, graph_trainer's
    default checkpoint policy chosen on our joint graph (matmul and attention outputs saved, the rest
    recomputed in backward): the same recompute work as the graph_trainer rows;
  - `ours-auto`: the same with `fsdp_graph.backend(memory_budget_bytes=..., activation_checkpointing="auto")`
    under a budget (`--auto-budget-mib`, 128 MiB) below the step's predicted peak with every activation
    kept and above it with the policy (docs/benchmarks.md has both): the budget chooses the policy, then
    keeps groups unsharded with what it freed (docs/compiler.md, "Recomputing as the budget's choice");
  - `fsdp2-compile`: the same module and groups with torch's `fully_shard` and `torch.compile(root)`;
  - `floor`: no communication: 2 processes at once, each its half batch, unsharded, `torch.compile(root)`.
Each row runs as its users get it by default: graph_trainer with its graph-level activation
checkpointing (save matmuls and attention, recompute the rest), the others keeping every activation
but `ours-ac` and `ours-auto`.
Every row's clock starts with Inductor imported: at the `torch.compile` call (graph_trainer: at its
first step, where it traces and compiles). A step is timed on each rank from a barrier to the end of
its optimizer step; a step's time is its slower rank's. Steady step: the median of the `--steps` steps
after `--warmup` of both launches. Losses: the global mean of every step (the floor: the mean of its
two processes', each of which trains on its own half: only its first step is comparable), against
the FSDP2 row's.

What graph_trainer needs on the CPU, applied at run time in its rows only (printed in the output):
  1. `torch.utils._runtime_estimation.get_gpu_dram_gbps` returns a constant: the overlap scheduler under
     its bucketing pass estimates every node's runtime when it is built, and this function imports
     triton (a GPU package). The value is never used: the manual scheduler it runs ignores estimates.
     (`get_device_tflops`, the other estimate, already returns 0 on a machine without CUDA.)
  2. The CPU SDPA kernel (`aten._scaled_dot_product_flash_attention_for_cpu`) joins the save list of
     its graph-level checkpoint policy (graph_trainer's `memory_policy._get_default_save_ops`), as
     the CUDA SDPA kernels are: else attention is recomputed in backward, and its rematerialisation
     pass refuses the graph (the kernel is tagged `nondeterministic_seeded`, for its dropout).
Its CUDA-graph pass needs no patch: on the CPU it finds the graph incompatible and skips itself.
Besides those, every row gets examples/torchtitan_on_cpu.py's `prepare()` (CPU as torchtitan's device,
placeholder expert-parallel kernels), as examples/benchmark_torchtitan.py's rows do.

    python examples/benchmark_graph_trainer.py --markdown gt.md                 # every row, 1024 tokens per rank
    python examples/benchmark_graph_trainer.py --steps 3 --warmup 1 --seq 128   # a quick check that every row runs
Run it on a quiet machine. This is a benchmark, not a test: it asserts nothing.
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
GROUPS = {"blocks": "each block, then the root (embedding, norm and output)",
          "torchtitan": "torchtitan's recipe (embedding, each block, norm + output unsharded until backward, root)"}
NAMES = {"gt-full": "graph_trainer, full Inductor",
         "gt-regional": "graph_trainer, regional Inductor (its default)",
         "ours-budget": "fsdp_graph whole step, selective unsharding",
         "ours": "fsdp_graph whole step",
         "ours-fast": "fsdp_graph whole step, fast compile (compiler=\"aot_eager\")",
         "ours-ac": "fsdp_graph whole step, graph_trainer's checkpoint policy",
         "ours-auto": "fsdp_graph whole step, the budget choosing the policy and unsharding",
         "fsdp2-compile": "FSDP2 + torch.compile",
         "floor": "no-communication floor (2 processes, each its half)"}
REFERENCES = {"gt-full": "graph_trainer full", "gt-regional": "graph_trainer regional",
              "fsdp2-compile": "FSDP2 + compile", "floor": "floor"}
PATCHES = ("torch.utils._runtime_estimation.get_gpu_dram_gbps -> a constant (it imports triton; graph_trainer's "
           "manual overlap scheduler computes estimates and never uses them)",
           "graph_trainer memory_policy._get_default_save_ops + aten._scaled_dot_product_flash_attention_for_cpu "
           "(the CPU SDPA kernel saved, as the CUDA ones are)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(NAMES), help=f"comma-separated rows, of {','.join(NAMES)}")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per rank per step (batch 1)")
    parser.add_argument("--layers", type=int, default=6, help="the debug model's first LAYERS layers (it has 6)")
    parser.add_argument("--steps", type=int, default=10, help="steady steps timed per launch, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per launch; the first compiles")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate, every row")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")
    parser.add_argument("--budget-mib", type=int, default=1024, help="ours-budget's memory_budget_bytes, in MiB")
    parser.add_argument("--auto-budget-mib", type=int, default=128, help="ours-auto's memory_budget_bytes, in MiB")
    parser.add_argument("--groups", choices=tuple(GROUPS), default="blocks",
                        help="the fully_shard groups of the FSDP rows: " + "; or ".join(GROUPS.values()))
    parser.add_argument("--no-priming", action="store_true",
                        help="skip the untimed launch made first (it pays what outlives an Inductor cache folder)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown, with date, machine and command")
    parser.add_argument("--worker", metavar="ROW", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        args.rows = parse_rows(parser, args.rows, NAMES)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first warm-up step compiles)")
    return args


# -- one row, on one rank, under torchrun ------------------------------------------------------------


def graph_trainer_config(args):
    """graph_trainer's config of the llama3 debug model on SDPA, with a plain cross-entropy loss
    (sum over this rank's tokens over the global count), on this run's sizes and CPU stand-ins."""
    import torchtitan_on_cpu
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.experiments.graph_trainer.configs import to_graph_trainer_config
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    from torchtitan.models.common.config_utils import decoder_vocab_size

    base = torchtitan_on_cpu.debug_config(tempfile.mkdtemp(prefix="gt-assets-"), layers=args.layers, seq_len=args.seq,
                                          batch=1, steps=args.warmup + args.steps, spmd_backend="partial_dtensor")
    base.model_spec = model_registry("debugmodel", attn_backend="sdpa")
    base.model_spec.model.layers = base.model_spec.model.layers[:args.layers]
    config = to_graph_trainer_config(base, model_registry)
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


def plain_model(config, seed: int):
    """torchtitan's own Llama3Model with the fields of `config`'s model (graph_trainer's subclass of
    it differs in nothing else), on the CPU, initialised from `seed`."""
    import copy
    import dataclasses

    import torch
    from torchtitan.models.llama3 import Llama3Model

    graph_model_config = copy.deepcopy(config.model_spec.model)
    model_config = Llama3Model.Config(**{f.name: getattr(graph_model_config, f.name) for f in dataclasses.fields(graph_model_config)})
    model_config.update_from_config(config=config)
    torch.manual_seed(seed)
    model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def loss_model(model):
    """The model and its loss in one module, as HF models compute theirs when given labels: this is
    the fully_shard root and what torch.compile compiles, so the loss is in the compiled graph."""
    import torch
    import torch.nn.functional as F

    class LossModel(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, tokens, labels):
            logits = self.model(tokens)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return LossModel(model)


def patch_graph_trainer_for_cpu() -> None:
    """The two patches of the docstring."""
    import torch
    import torch.utils._runtime_estimation as runtime_estimation
    from torchtitan.experiments.graph_trainer import memory_policy

    runtime_estimation.get_gpu_dram_gbps = lambda: 100
    save_ops = memory_policy._get_default_save_ops
    memory_policy._get_default_save_ops = lambda: save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def graph_trainer_row(args, config, initial: dict, inductor: str):
    """GraphTrainer built from `config`, its weights set to `initial`: (start, parameters, how ranks' losses add)."""
    import torch
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig

    patch_graph_trainer_for_cpu()
    config.compile = GraphTrainerCompileConfig(enable=True, inductor_compilation=inductor)
    trainer = config.build()
    model = trainer.model_parts[0]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.to_local().copy_(distribute_tensor(initial[name], param.device_mesh, param.placements).to_local())
    global_tokens = torch.tensor(2 * args.seq, dtype=torch.int64)

    def step(tokens, labels):  # this rank's summed loss over the global token count, as torchtitan's trainer
        return trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels, global_valid_tokens=global_tokens)

    return (lambda: step), list(model.parameters()), "sum"


def compiled_row(row: str, args, config, initial: dict):
    """A row compiled with torch.compile: (start, parameters, how ranks' losses add)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = plain_model(config, args.seed)
    model.load_state_dict(initial)
    root = loss_model(model)
    if row == "floor":
        backend, reduce = "inductor", "own"
    else:
        if row == "fsdp2-compile":
            from torch.distributed.fsdp import fully_shard

            backend = "inductor"
        else:
            import fsdp_graph
            from fsdp_graph import fully_shard

            backend = {"ours": "fsdp_graph", "ours-fast": fsdp_graph.backend(compiler="aot_eager"),
                       "ours-budget": fsdp_graph.backend(memory_budget_bytes=args.budget_mib << 20),
                       "ours-ac": fsdp_graph.backend(activation_checkpointing="save_matmuls"),
                       "ours-auto": fsdp_graph.backend(memory_budget_bytes=args.auto_budget_mib << 20,
                                                       activation_checkpointing="auto")}[row]
        shard_groups(args.groups, model, root, fully_shard)
        reduce = "mean"

    def start():
        compiled = torch.compile(root, backend=backend)

        def step(tokens, labels):  # this rank's mean loss; fully_shard averages the gradients
            loss = compiled(tokens, labels)
            loss.backward()
            return loss

        return step

    return start, list(root.parameters()), reduce


def shard_groups(groups: str, model, root, fully_shard) -> None:
    """The FSDP rows' `fully_shard` calls: each block, then the root (the embedding, norm and output
    in the root's group); with `groups` "torchtitan", as torchtitan's own recipe makes them (its
    `apply_fsdp`: the embedding, each block, the final norm with the output layer kept unsharded
    until backward, then the root), the groups graph_trainer buckets by."""
    if groups == "torchtitan":
        fully_shard(model.tok_embeddings)
    for block in model.layers.values():
        fully_shard(block)
    if groups == "torchtitan":
        fully_shard([model.norm, model.lm_head], reshard_after_forward=False)
    fully_shard(root)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import torchtitan_on_cpu

    torchtitan_on_cpu.prepare()
    import torch._inductor.compile_fx  # noqa: F401  every row's clock starts with Inductor imported

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    rank = int(os.environ["RANK"])
    config = graph_trainer_config(args)
    initial = {name: p.detach().clone() for name, p in plain_model(config, args.seed).named_parameters()}
    if args.worker.startswith("gt-"):
        start, params, reduce = graph_trainer_row(args, config, initial, args.worker.removeprefix("gt-"))
    else:
        start, params, reduce = compiled_row(args.worker, args, config, initial)
    optimizer = torch.optim.AdamW(params, lr=args.lr, foreach=True)
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same global batches for every row
    batches = [torch.randint(0, config.model_spec.model.vocab_size, (2, args.seq + 1), generator=generator)[rank:rank + 1]
               for _ in range(args.warmup + args.steps)]

    times, losses = [], []
    dist.barrier()
    began = time.perf_counter()
    step = start()
    for i, batch in enumerate(batches):
        if i:
            dist.barrier()
            began = time.perf_counter()
        loss = step(batch[:, :-1], batch[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
        losses.append(loss.detach().clone())
    times_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(times_t, op=dist.ReduceOp.MAX)  # a step ends when its slower rank is done
    losses_t = torch.stack(losses).double()
    dist.all_reduce(losses_t)
    if reduce != "sum":  # a mean per rank (the floor's: each its own half), equal token counts
        losses_t /= dist.get_world_size()
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"steps_s": times_t.tolist(), "losses": losses_t.tolist()}, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the launches and the table ------------------------------------------------------------------------


def launch(args, row: str, cache_dir: str) -> dict:
    """One 2-rank launch of this script's worker with one row; its JSON figures."""
    out = os.path.join(cache_dir, f"{row}.json")
    arguments = ["--worker", row, "--json", out]
    for flag in ("seq", "layers", "steps", "warmup", "lr", "seed", "budget_mib", "auto_budget_mib", "groups"):
        arguments += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return run_two_ranks(HERE, arguments, out, os.path.join(cache_dir, "inductor"), row)


def measure(args, row: str) -> dict:
    """A row's cold launch and relaunch, in a cache folder of their own: its figures."""
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = launch(args, row, cache_dir)
        warm = launch(args, row, cache_dir)
    steady = statistics.median(cold["steps_s"][args.warmup:] + warm["steps_s"][args.warmup:])
    relaunch_diff = max(abs(a - b) for a, b in zip(cold["losses"], warm["losses"]))
    print(f"{NAMES[row]:52} cold {cold['steps_s'][0]:6.1f} s, relaunch {warm['steps_s'][0]:6.1f} s, "
          f"steady {steady:.3f} s, losses {' '.join(f'{x:.4f}' for x in cold['losses'])} "
          f"(the relaunch's differ by {relaunch_diff:.1e})", flush=True)
    return {"cold": cold["steps_s"][0], "relaunch": warm["steps_s"][0], "steady": steady, "losses": cold["losses"]}


def loss_diff(results: dict, row: str) -> str:
    """The largest difference between a row's losses and the FSDP2 row's."""
    if row == "fsdp2-compile" or "fsdp2-compile" not in results:
        return "(reference)" if row == "fsdp2-compile" else "n/a"
    losses, reference = results[row]["losses"], results["fsdp2-compile"]["losses"]
    if row == "floor":
        return f"{abs(losses[0] - reference[0]):.1e} (first step only)"
    return f"{max(abs(a - b) for a, b in zip(losses, reference)):.1e}"


def report(args, results: dict) -> None:
    """Print the figures and the ratios (and write them with --markdown)."""
    header = ["row", "steady step s", "cold first step s", "relaunch first step s", "losses: max abs diff vs FSDP2 + compile"]
    table = [[NAMES[row], f"{r['steady']:.3f}", f"{r['cold']:.1f}", f"{r['relaunch']:.1f}", loss_diff(results, row)]
             for row, r in results.items()]
    columns = [("steady", ref) for ref in REFERENCES if ref in results]
    columns += [(what, ref) for what in ("cold", "relaunch") for ref in REFERENCES if ref in results and ref != "floor"]
    ratio_header = ["row"] + [f"{what} vs {REFERENCES[ref]}" for what, ref in columns]
    ratios = [[NAMES[row]] + [f"{r[what] / results[ref][what]:.2f}" for what, ref in columns] for row, r in results.items()]
    for head, body in ((header, table), (ratio_header, ratios)):
        print("\n".join(" | ".join(line) for line in [head, *body]))
    if args.markdown:
        caption = (f"torchtitan 0.3.0 llama3 debug model (SDPA), {args.layers} layers, 1x{args.seq} tokens per rank, "
                   f"fp32, AdamW (foreach, lr {args.lr}), 2 gloo ranks, the loss inside every compiled graph. Each row: "
                   f"one launch with an empty Inductor cache (cold), then one with the cache it left (relaunch); first "
                   f"steps in wall seconds from the compile call, steady step the median of the {args.steps} steps after "
                   f"{args.warmup} warm-up step(s) of both launches; a step's time is its slower rank's. The FSDP rows' "
                   f"groups: {GROUPS[args.groups]}. Selective "
                   f"unsharding's memory_budget_bytes: {args.budget_mib} MiB; ours-auto's: {args.auto_budget_mib} MiB. "
                   f"graph_trainer checkpoints activations by its default graph-level policy, as do ours-ac and "
                   f"ours-auto (chosen by its budget) by the same policy; the other rows keep them all.")
        notes = ["graph_trainer's rows ran with these patches for the CPU (see the script's docstring):"]
        notes += [f"{i}. {p}" for i, p in enumerate(PATCHES, 1)]
        sections = [(caption, header, table), ("Ratios (below 1: faster than the reference):", ratio_header, ratios)]
        print(f"markdown: {write_markdown(args.markdown, 'Against torchtitan graph_trainer', sections, notes)}")


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    print("graph_trainer's rows run with these patches:", *(f"  {i}. {p}" for i, p in enumerate(PATCHES, 1)), sep="\n", flush=True)
    if not args.no_priming:
        with tempfile.TemporaryDirectory() as cache_dir:
            launch(args, "floor", cache_dir)
    report(args, {row: measure(args, row) for row in args.rows})


if __name__ == "__main__":
    main()
