"""Benchmark the compiled path: fsdp_graph's scheduling against no scheduling, FSDP2 and Inductor's own passes.

CPU / gloo, 2 ranks, the 8-block example Llama (timings):
    torchrun --nproc-per-node 2 examples/benchmark_compile.py
    torchrun --nproc-per-node 2 examples/benchmark_compile.py --dim 128 --seq-len 64 --rounds 5   # quicker
    torchrun --nproc-per-node 2 examples/benchmark_compile.py --rounds 10 --markdown compiled.md   # table for docs/benchmarks.md

The per-model tables of docs/benchmarks.md, one launch per model (ours, hf-llama, hf-gpt2; the hf extra):
    torchrun --nproc-per-node 2 examples/benchmark_compile.py --model hf-gpt2 --dim 256 --layers 4 --seq-len 64 \
        --batch-size 4 --rows scheduled,selective,fsdp2-eager,fsdp2-compile,floor,collectives --rounds 9 --markdown gpt2.md
Any other transformers causal LM, by class name (built from its config at the same sizes, one group per block):
    torchrun --nproc-per-node 2 examples/benchmark_compile.py --model hf:Qwen2ForCausalLM --dim 256 --layers 4 --seq-len 64 \
        --batch-size 4 --rows selective,fsdp2-eager,fsdp2-compile,floor,collectives --rounds 9
Every row steps AdamW's foreach implementation (`--optimizer for-loop` for torch's CPU default), as on CUDA.
Where the time goes: `--profile-dir prof` profiles one more step of each row (a Chrome trace per row and rank there,
rank 0's forward / backward / optimizer split, its bucket copies (copy-in, copy-out, gradient packing; ours and
FSDP2's) and ops by self CPU time printed); with `FSDP_GRAPH_DUMP=dump`, compare
our row's trace with the predicted schedule: `python -m fsdp_graph.inspect dump --trace t.json --measured prof/<row>.rank0.json`.

Compile cost against depth: an HF LlamaForCausalLM (the `hf` extra), only our row and FSDP2 + torch.compile, each
launch with an empty Inductor cache (a second launch with the same cache is the warm relaunch; benchmark_depth.py
runs the series). `block-scope` is ours compiled with `fsdp_graph.backend(scope="block")` (block by block, the
collectives on the eager hooks), `regions` the whole step with the blocks as nested_compile_regions,
`every-block` the same with `fsdp_graph.backend(regions="blocks")` and no block marked (the default,
so the same as `scheduled`), `inline` the whole step with no regions (`regions="marked"`, no
block marked: every layer traced in the step's graph, the earlier default):
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) torchrun --nproc-per-node 2 examples/benchmark_compile.py \
        --model hf-llama --dim 128 --seq-len 64 --layers 16 --rows scheduled,fsdp2-compile --rounds 3
Rows of one launch share Inductor's in-process caches, so the row compiled second may reuse kernels of
the first; for cold first steps of one row alone, pass one row per launch (`--rows scheduled`).

Predicted exposed communication of a Llama-3-8B-shaped model at world size 8 (one process, a fake
8-rank process group, meta tensors: nothing is allocated or computed, the full 32-layer graph is
traced; shapes as Llama-3-8B except full multi-head attention instead of grouped-query: 8.84B params;
4 sequences of 2048 tokens per rank, since on CPU scaled_dot_product_attention traces as the math kernel
whose seq x seq scores a GPU's flash attention would not store):
    python examples/benchmark_compile.py --predict-8b --profile h100-nvlink
    python examples/benchmark_compile.py --predict-8b --timeline 8b.svg --trace 8b.json   # our schedule, drawn

Timing rows: fsdp_graph compiled (Inductor) with the scheduling passes, the same without them,
PyTorch's FSDP2 eager, FSDP2 + torch.compile, the first row through `fsdp_graph.precompile` (its
first step compiles and saves to --precompile-dir; run the benchmark again, a relaunch, and it
loads), our captured graph with Inductor's in-tree FX
bucketing and comm reordering instead of our passes, the floor: the same model unsharded and
compiled, each of the two processes on its own half batch at once, with no communication, and
"collectives only": the collectives of the selective row's step (the scheduled row's without it),
the same ops and bytes, with no compute. The measured bound is the floor plus that row; each row is
reported against FSDP2 eager, the floor and the bound. Steps alternate between the rows. Per row:
median step time (each step's slowest rank: a step ends when both ranks are done), collectives per step (gloo's profiler events), peak heap
above a step's start (glibc's in-use bytes, sampled; the highest of 3 steps and of the ranks).
The prediction compares, on the chosen profile, the unscheduled graph, our schedule, and Inductor's
`schedule_overlap_bucketing` run on the same graph with our cost model's estimates.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import write_markdown  # noqa: E402
from llama import Llama, LlamaConfig, shard_llama  # noqa: E402

import fsdp_graph  # noqa: E402
from fsdp_graph import MixedPrecisionPolicy, fully_shard  # noqa: E402

SCHEDULING = {"bucket_by_group", "auto_bucket", "reorder_for_overlap", "pin_order"}
ROWS = ("scheduled", "one-graph", "regions", "every-block", "inline", "block-scope", "selective", "unscheduled", "fsdp2-eager", "fsdp2-compile", "precompiled", "inductor-passes",
        "blocks", "fsdp2-blocks", "floor", "collectives")
MODELS = {"ours": "Llama (examples/llama.py)", "hf-llama": "HF LlamaForCausalLM", "hf-gpt2": "HF GPT2LMHeadModel"}


def model_name(model: str) -> str:
    return MODELS.get(model) or f"HF {model[3:]}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row (the first compiles)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model", default="ours",
                        help="examples/llama.py's Llama (ours), or transformers' LlamaForCausalLM (hf-llama) or GPT2LMHeadModel "
                             "(hf-gpt2) of the same width and depth (the hf extra); or any transformers causal LM by class name, "
                             "hf:<class> (hf:Qwen2ForCausalLM), built from its config with the same sizes, one group per block of "
                             "its largest ModuleList")
    parser.add_argument("--optimizer", choices=("foreach", "for-loop"), default="foreach",
                        help="AdamW's implementation in every row: foreach (torch's default for CUDA tensors, DTensors included, "
                             "and torchtitan's) or for-loop (torch's default on CPU: each parameter's ops dispatched one by one, "
                             "which costs the sharded rows DTensor's per-op dispatch and the floor not)")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated rows to run, of {','.join(ROWS)} (selective needs fsdp2-eager: its budget; "
                             "collectives replays the selective row's collectives, or the scheduled row's without it)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--precompile-dir", default=os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp"), "fsdp_graph_precompiled"),
                        help="where the precompiled row saves its step (a relaunch loads it)")
    parser.add_argument("--predict-8b", action="store_true", help="only the Llama-3-8B prediction, one process")
    parser.add_argument("--profile", default="h100-nvlink", help="hardware profile of the prediction")
    parser.add_argument("--predict-batch", type=int, default=4, help="sequences per rank in the prediction")
    parser.add_argument("--predict-seq-len", type=int, default=2048, help="tokens per sequence in the prediction")
    parser.add_argument("--predict-trace-all", action="store_true",
                        help="trace every block (default: trace four and stamp the rest out, passes/stamp.py)")
    parser.add_argument("--budget-gib", type=float, help="with --predict-8b: memory_budget_bytes for selective unsharding")
    parser.add_argument("--timeline", help="with --predict-8b: write our schedule's SVG timeline here (see fsdp_graph.inspect)")
    parser.add_argument("--trace", help="with --predict-8b: write our schedule as a Chrome trace (Perfetto) here")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table (the timings, or with --predict-8b the prediction) as markdown, with date, machine and command")
    parser.add_argument("--json", metavar="FILE", help="also write each row's figures as JSON (benchmark_depth.py reads them)")
    parser.add_argument("--profile-dir", help="after the timed rounds, profile one more step of each row: a Chrome trace per row and "
                                                "rank here, and rank 0's ops by self CPU time printed (where the time goes)")
    args = parser.parse_args()
    if args.model not in MODELS and not args.model.startswith("hf:"):
        parser.error(f"--model {args.model}: one of {', '.join(MODELS)}, or hf:<a transformers causal LM class>")
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows names {unknown}, which are not rows; rows: {','.join(ROWS)}")
    return args


# -- timings on 2 gloo ranks ---------------------------------------------------------------------------


class Row:
    def __init__(self, name: str, model: torch.nn.Module, compile_backend=None, inductor_patches=None,
                 precompile_dir=None, compile_blocks=False, foreach=True) -> None:
        self.name = name
        self.model = model
        # The first step counts from the torch.compile call: torch.compile(model) imports Inductor
        # there, our backend at its first compile, and a user waits for both.
        start, start_cpu = time.perf_counter(), cpu_seconds()
        self.run = torch.compile(model, backend=compile_backend) if compile_backend is not None else model
        if compile_blocks:  # torchtitan's way: each sharded block compiled on its own, the root eager
            from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

            for sub in model.modules():
                if sub is not model and isinstance(sub, (fsdp_graph.FSDPModule, TorchFSDPModule)):
                    sub.compile(backend="inductor")
        self.compile_call_s, self.compile_call_cpu_s = time.perf_counter() - start, cpu_seconds() - start_cpu
        if precompile_dir is not None:  # fsdp_graph.precompile in the first step: compiles and saves, or loads
            self.run = None
            self.precompile = lambda tokens: fsdp_graph.precompile(model, (tokens,), save_dir=precompile_dir, backend=compile_backend)
        self.patches = inductor_patches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        self.times: list[float] = []
        self.first_step_s = 0.0  # the first warm-up step: compiles, for compiled rows
        self.first_step_cpu_s = 0.0  # its CPU time, compiler processes included: steadier than wall time on a loaded machine
        self.peak = "n/a"
        self.collectives = "n/a"
        self.gathered_mib = "n/a"

    def step(self, tokens: torch.Tensor) -> float:
        patch = torch._inductor.config.patch(self.patches) if self.patches else nullcontext()
        with patch:
            if self.run is None:
                self.run = self.precompile(tokens[:, :-1])
            with torch.profiler.record_function("bench::forward"):
                logits = self.run(tokens[:, :-1])
                logits = getattr(logits, "logits", logits)  # transformers' CausalLMOutput
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            with torch.profiler.record_function("bench::backward"):
                loss.backward()
        with torch.profiler.record_function("bench::optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss.item()

    def timed_step(self, tokens: torch.Tensor) -> None:
        dist.barrier()
        start = time.perf_counter()
        self.step(tokens)
        self.times.append(time.perf_counter() - start)

    def measure(self, tokens: torch.Tensor, steps: int = 3) -> None:
        peak = 0
        for _ in range(steps):  # the highest of a few: a sampled peak can be missed, never invented
            with HeapPeak() as heap:
                self.step(tokens)
            peak = max(peak, heap.peak_bytes)
        peak_t = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        self.peak_bytes = int(peak_t.item())
        self.peak = f"{peak_t.item() / 2**20:.1f}"
        wire = collectives_of(self, tokens)
        counts: dict[str, int] = {}
        for kind, _, _ in wire:
            counts[kind] = counts.get(kind, 0) + 1
        self.collectives = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        gathered = sum(numel * dist.get_world_size() * dtype.itemsize for kind, numel, dtype in wire if kind == "all_gather")
        self.gathered_mib = f"{gathered / 2**20:.1f}"


_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "double": torch.float64}


def collectives_of(row: Row, tokens: torch.Tensor) -> list[tuple[str, int, torch.dtype]]:
    """What one step of `row` puts on the wire: (gloo's op, elements this rank sends in, dtype) per
    collective, from gloo's own profiler events, so eager and compiled steps count alike. Gloo runs a
    reduce-scatter as an all-reduce of the full buffer; `all_reduce` here is that."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        row.step(tokens)
    wire = []
    for event in prof.events():
        if event.name.startswith("gloo:") and event.input_shapes and event.input_shapes[0]:
            wire.append((event.name[5:], math.prod(event.input_shapes[0]), _DTYPES[event.input_dtypes[0]]))
    # A replay must issue the same collectives in the same order on every rank, and the events of
    # collectives in flight at once may be listed in another order on each (a replay hung once, both
    # ranks waiting in it): rank 0's list for all.
    shared = [wire]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


class CollectivesOnly(Row):
    """The collectives of another row's step with no compute: the same ops, bytes and count, all
    issued at once and then waited on (the least they cost here, with gloo's threads moving and
    adding the bytes on the cores the step computes on). Its step time plus the floor's is the
    measured bound for that row."""

    def __init__(self, name: str, wire: list[tuple[str, int, torch.dtype]]) -> None:
        super().__init__(name, torch.nn.Linear(1, 1))
        world = dist.get_world_size()
        # The sent buffers, made once (zeros: no denormals or NaNs to slow the additions); outputs
        # are allocated per step, as the step allocates its gathered buffers.
        self.wire = [(kind, torch.zeros(numel, dtype=dtype), numel * world if kind == "all_gather" else numel // world)
                     for kind, numel, dtype in wire]
        if any(kind not in ("all_gather", "all_reduce") for kind, _, _ in self.wire):
            raise ValueError(f"cannot replay {sorted({k for k, _, _ in self.wire})}: only all_gather and all_reduce")

    def step(self, tokens: torch.Tensor) -> float:
        works = []
        for kind, sent, out_numel in self.wire:
            out = torch.empty(out_numel, dtype=sent.dtype)
            if kind == "all_gather":
                works.append(dist.all_gather_into_tensor(out, sent, async_op=True))
            else:  # a reduce-scatter, which gloo runs as an all-reduce of `sent`
                works.append(dist.reduce_scatter_tensor(out, sent, async_op=True))
        for work in works:
            work.wait()
        return 0.0


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (Inductor's compiler workers and C++ compilers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class HeapPeak:
    """Peak of glibc's in-use heap bytes (mallinfo2) over a block, above its level at entry.

    Sampled by a thread every 0.2 ms: the same yardstick for eager and compiled rows, where
    torch's MemTracker (a dispatch mode) would make compiled code fall back to eager.
    """

    def __init__(self) -> None:
        import ctypes

        class _MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        self._in_use = lambda: libc.mallinfo2().uordblks + libc.mallinfo2().hblkhd
        self.peak_bytes = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._in_use() - self._base)
            time.sleep(0.0002)

    def __enter__(self) -> "HeapPeak":
        import threading

        self._base = self._in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def hf_causal_lm(class_name: str, vocab: int, dim: int, layers: int, positions: int) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """A transformers causal LM by class name, from its config class with these sizes (the names most
    configs share; 4 heads, 2 of them for keys and values where the model has grouped-query
    attention), and its blocks: the ModuleList holding the most parameters."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise SystemExit(f"--model hf:{class_name}: transformers {transformers.__version__} has no such model class")
    model = cls(cls.config_class(
        vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, pad_token_id=0, use_cache=False))
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise SystemExit(f"--model hf:{class_name}: no ModuleList of blocks to shard")
    return model, max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))


def timings(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cfg = LlamaConfig(vocab_size=256, dim=args.dim, num_layers=args.layers, num_heads=4,
                      hidden_dim=args.dim * 11 // 4, max_seq_len=args.seq_len + 1)

    def model(shard):
        torch.manual_seed(0)
        if args.model == "ours":
            return shard_llama(Llama(cfg), shard)
        if args.model == "hf-llama":
            from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

            hf = LlamaForCausalLM(HFLlamaConfig(
                vocab_size=cfg.vocab_size, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3, num_hidden_layers=args.layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len + 1, use_cache=False))
            blocks = hf.model.layers
        elif args.model.startswith("hf:"):
            hf, blocks = hf_causal_lm(args.model[3:], cfg.vocab_size, args.dim, args.layers, args.seq_len + 1)
        else:  # GPT-2: tied input/output embeddings (both in the root group), Conv1D (transposed) weights
            from transformers import GPT2Config, GPT2LMHeadModel

            hf = GPT2LMHeadModel(GPT2Config(
                vocab_size=cfg.vocab_size, n_embd=args.dim, n_layer=args.layers, n_head=4, n_positions=args.seq_len + 1,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
            blocks = hf.transformer.h
        for block in blocks:  # one group per transformer block, then the root
            shard(block)
        shard(hf)
        return hf

    def marked_as_regions(build):
        """`build()` with every block's forward a torch.compiler.nested_compile_region, marked on one
        subclass per block class (made here, so that other rows keep the plain class; one for all
        blocks, since Dynamo reuses a region body only for the same code)."""
        marked: dict[type, type] = {}

        def marked_shard(module):
            cls = module.__class__
            if cls.__name__ in ("Block", "LlamaDecoderLayer", "GPT2Block"):
                if cls not in marked:
                    marked[cls] = type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(cls.forward)})
                module.__class__ = marked[cls]
            return fully_shard(module)
        return build(marked_shard)

    def make_row(*args_, **kwargs) -> Row:
        return Row(*args_, foreach=args.optimizer == "foreach", **kwargs)

    ours = fsdp_graph.backend(compiler="inductor")
    unscheduled = fsdp_graph.backend(compiler="inductor", disabled_passes=SCHEDULING)
    in_tree = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all", "reorder_for_compute_comm_overlap": True}
    makers = {
        "scheduled": lambda: make_row("fsdp_graph scheduled", model(fully_shard), ours),
        # The same with pieces=False: Inductor compiles each scheduled graph whole, not piece by piece.
        "one-graph": lambda: make_row("fsdp_graph scheduled, one graph", model(fully_shard),
                                      fsdp_graph.backend(compiler="inductor", pieces=False)),
        # The same, the blocks marked as compile regions: one body compiled for all blocks.
        "regions": lambda: make_row("fsdp_graph scheduled, blocks as regions", marked_as_regions(model), ours),
        # The same regions, no class marked: the backend makes every block one (regions="blocks").
        "every-block": lambda: make_row("fsdp_graph scheduled, regions=blocks", model(fully_shard),
                                        fsdp_graph.backend(compiler="inductor", regions="blocks")),
        # The same with no regions: every layer traced inline in the step's graph.
        "inline": lambda: make_row("fsdp_graph scheduled, no regions", model(fully_shard),
                                   fsdp_graph.backend(compiler="inductor", regions="marked")),
        # The whole model compiled with scope="block": FSDP2 + compile's structure, with our runtime.
        "block-scope": lambda: make_row("fsdp_graph scope=block", model(fully_shard), fsdp_graph.backend(compiler="inductor", scope="block")),
        "unscheduled": lambda: make_row("fsdp_graph unscheduled", model(fully_shard), unscheduled),
        "fsdp2-eager": lambda: make_row("FSDP2 eager", model(torch_fully_shard)),
        "fsdp2-compile": lambda: make_row("FSDP2 + compile", model(torch_fully_shard), "inductor"),
        # The same as the first row, its step saved by fsdp_graph.precompile: a relaunch loads it.
        "precompiled": lambda: make_row("fsdp_graph precompiled", model(fully_shard), ours, precompile_dir=args.precompile_dir),
        # Inductor's passes see the collectives only in a graph it compiles whole
        "inductor-passes": lambda: make_row("ours + Inductor passes", model(fully_shard),
                                            fsdp_graph.backend(compiler="inductor", disabled_passes=SCHEDULING, pieces=False), in_tree),
        "blocks": lambda: make_row("fsdp_graph blocks compiled", model(fully_shard), compile_blocks=True),
        "fsdp2-blocks": lambda: make_row("FSDP2 blocks compiled", model(torch_fully_shard), compile_blocks=True),
        # The floor for any FSDP here: both ranks compute their own half batch at once, compiled,
        # unsharded, with no collective at all (the optimizer steps on local parameters).
        "floor": lambda: make_row("floor: no sharding/comm", model(lambda module: module), "inductor"),
    }
    rows = [makers[key]() for key in ROWS if key in makers and key in args.rows]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]
    def warm_up(row: Row) -> bool:
        try:
            for i in range(args.warmup):
                start, start_cpu = time.perf_counter(), cpu_seconds()
                row.step(batches[i % len(batches)])
                if i == 0:  # includes the cold compile of compiled rows, and the torch.compile call
                    row.first_step_s = row.compile_call_s + time.perf_counter() - start
                    row.first_step_cpu_s = row.compile_call_cpu_s + cpu_seconds() - start_cpu
            return True
        except Exception as error:
            if rank == 0:
                print(f"{row.name}: failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
            return False

    rows = [row for row in rows if warm_up(row)]
    fsdp2 = next((r for r in rows if r.name == "FSDP2 eager"), None)
    if "selective" in args.rows and fsdp2 is not None:
        # Selective unsharding (passes/unshard_selection.py) with FSDP2 eager's measured peak heap as
        # the memory budget: the groups that fit stay unsharded from forward to backward.
        fsdp2.measure(batches[0])
        budget = fsdp2.peak_bytes // 2**20 * 2**20  # whole MiB: the same budget (and compile-cache key) each run
        selective = make_row("fsdp_graph selective", model(fully_shard), fsdp_graph.backend(compiler="inductor", memory_budget_bytes=budget))
        if warm_up(selective):
            rows.insert(1, selective)
        if rank == 0:
            print(f"selective unsharding budget: {budget / 2**20:.1f} MiB (FSDP2 eager's peak heap)")
    source = next((r for name in ("fsdp_graph selective", "fsdp_graph scheduled") for r in rows if r.name == name), None)
    if "collectives" in args.rows and source is not None:
        # The measured bound's second half: the collectives of the target row's step, without compute.
        replay = CollectivesOnly(f"collectives only (of {source.name.split()[-1]})", collectives_of(source, batches[0]))
        if warm_up(replay):
            rows.append(replay)
    for i in range(args.rounds):
        for row in rows if i % 2 == 0 else reversed(rows):  # alternate who goes first
            row.timed_step(batches[i % len(batches)])
        if rank == 0:
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr)
    for row in rows:
        row.measure(batches[0])
    if args.profile_dir:
        for row in rows:
            where_the_time_goes(args.profile_dir, row, batches[0])
    for row in rows:  # a step ends when its last rank is done: the floor's two processes included
        row.times = slowest_rank(row.times)
    if rank == 0:
        report(args, rows)
    dist.barrier()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


def slowest_rank(times: list[float]) -> list[float]:
    """Each step's time on the rank that took longest (every rank's steps start at one barrier)."""
    mine = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.tolist()


def where_the_time_goes(directory: str, row: Row, tokens: torch.Tensor, num_ops: int = 18) -> None:
    """One step of `row` under torch.profiler: its Chrome trace in `directory` (one per rank; for
    `python -m fsdp_graph.inspect DUMP --trace out.json --measured ...` beside the predicted
    schedule), and on rank 0 the step's phases and its ops by self CPU time."""
    os.makedirs(directory, exist_ok=True)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        row.step(tokens)
    slug = "".join(c if c.isalnum() else "_" for c in row.name).strip("_")
    prof.export_chrome_trace(os.path.join(directory, f"{slug}.rank{dist.get_rank()}.json"))
    if dist.get_rank() != 0:
        return
    averages = prof.key_averages()
    phases = {e.key: e.cpu_time_total for e in averages if e.key.startswith("bench::")}
    total = sum(phases.values()) or 1.0
    print(f"\n{row.name}: " + ", ".join(f"{k[7:]} {v / 1e3:.1f} ms" for k, v in phases.items()))
    copies = bucket_copies(prof.events())
    print("  bucket copies: " + ", ".join(f"{kind} {us / 1e3:.2f} ms" for kind, us in copies.items())
          + f" = {100 * sum(copies.values()) / total:.2f}% of the step")
    ops = sorted((e for e in averages if not e.key.startswith("bench::")), key=lambda e: -e.self_cpu_time_total)
    for e in ops[:num_ops]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms {100 * e.self_cpu_time_total / total:5.1f}%  x{e.count:<5} {e.key[:90]}")


# The ops that copy parameters into a bucket, out of it, and gradients into one: ours
# (runtime/bucket_layout.py) and FSDP2's, by kind.
COPY_OPS = {"fsdp_graph::copy_in": "copy-in", "fsdp::all_gather_copy_in": "copy-in",
            "fsdp_graph::copy_out": "copy-out", "fsdp::split_with_sizes_copy": "copy-out",
            "fsdp_graph::pack_grads": "packing", "fsdp::chunk_cat": "packing"}


def bucket_copies(events) -> dict[str, float]:
    """Microseconds of a profiled step in each kind of `COPY_OPS`, counting each op once where it
    calls itself (a functional op calls its `.out` overload, which the profiler names alike)."""
    def inside_a_copy(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in COPY_OPS:
                return True
            parent = parent.cpu_parent
        return False

    totals = dict.fromkeys(("copy-in", "copy-out", "packing"), 0.0)
    for event in events:
        if event.name in COPY_OPS and not inside_a_copy(event):
            totals[COPY_OPS[event.name]] += event.time_range.elapsed_us()
    return totals


def report(args, rows: list[Row]) -> None:
    """Print the table (and write it with --markdown): each row against FSDP2 eager, the floor and
    the measured bound (the floor plus the collectives-only row)."""
    median = {row.name: statistics.median(row.times) for row in rows}
    eager = median.get("FSDP2 eager", math.nan)
    floor = next((median[r.name] for r in rows if r.name.startswith("floor")), math.nan)
    alone = next((median[r.name] for r in rows if isinstance(r, CollectivesOnly)), math.nan)
    bound = floor + alone
    header = ["row", "step ms", "vs FSDP2 eager", "vs floor", "vs bound", "first step s: wall / CPU", "peak heap MiB",
              "gathered MiB per step", "collectives per step"]
    table = []
    for row in rows:
        t = median[row.name]
        vs_bound = "" if isinstance(row, CollectivesOnly) or row.name.startswith("floor") else f"{t / bound:.3f}"
        table.append([row.name, f"{t * 1e3:.1f}", f"{t / eager:.3f}", f"{t / floor:.3f}", vs_bound,
                      f"{row.first_step_s:.1f} / {row.first_step_cpu_s:.1f}", row.peak, row.gathered_mib, row.collectives])
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    for line in [header, *table]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)))
    print(f"bound = floor + collectives only = {bound * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"row": row.name, "step_ms": median[row.name] * 1e3, "first_step_s": row.first_step_s,
                        "first_step_cpu_s": row.first_step_cpu_s, "peak_mib": row.peak} for row in rows], f)
    if args.markdown:
        caption = (f"{model_name(args.model)}, {args.layers} blocks, dim {args.dim}, vocab 256, batch {args.batch_size}x{args.seq_len} per "
                   f"rank, fp32, AdamW ({args.optimizer}), {dist.get_world_size()} gloo ranks x 1 thread, median of {args.rounds} alternating rounds "
                   f"(each step's slowest rank). "
                   f"Bound: the floor plus the collectives-only row ({bound * 1e3:.1f} ms).")
        title = f"Compiled: {model_name(args.model)}"
        print(f"markdown: {write_markdown(args.markdown, title, [(caption, header, table)])}")


# -- predicted exposed communication, Llama-3-8B shape at world size 8 ----------------------------------


def exposed_at(sim) -> str:
    """Where a simulated graph stalls: its three most exposed collectives, with how many compute
    nodes ran between issue and wait."""
    worst = sorted((c for c in sim.collectives if c.exposed_s > 0), key=lambda c: -c.exposed_s)[:3]
    spans = [f"{c.kind} {c.group} {c.num_bytes / 2**20:.0f} MiB {c.exposed_s * 1e3:.2f} ms "
             f"({c.prefetch_distance} compute ahead)" for c in worst]
    return "exposed at: " + (", ".join(spans) or "nothing")


def predict_8b(args) -> None:
    from fsdp_graph.predict import capture_graphs, fake_world, schedule_graphs
    import unittest.mock

    from torch._inductor.fx_passes import overlap_scheduling
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from fsdp_graph.passes.cost_model import CostModel, op_facts
    from fsdp_graph.inspect.chrome_trace import write_trace
    from fsdp_graph.passes.nodes import is_all_gather, tensor_bytes
    from fsdp_graph.passes.simulator import program_of, simulate
    from fsdp_graph.inspect.timeline import write_timeline

    cost_model = CostModel(args.profile)
    cfg = LlamaConfig(vocab_size=128256, dim=4096, num_layers=32, num_heads=32, hidden_dim=14336, max_seq_len=args.predict_seq_len)
    with fake_world(8):
        with torch.device("meta"):
            model = Llama(cfg)
        num_params = sum(p.numel() for p in model.parameters())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_llama(model, lambda m: fully_shard(m, mp_policy=policy))
        start = time.perf_counter()
        budget = int(args.budget_gib * 2**30) if args.budget_gib is not None else None
        tokens = torch.randint(0, cfg.vocab_size, (args.predict_batch, args.predict_seq_len), device="meta")
        graphs = capture_graphs(model, tokens, memory_budget_bytes=budget,
                                repeated_blocks=None if args.predict_trace_all else model.layers)
        print(f"Llama-3-8B shape ({num_params / 1e9:.2f}B params), {args.predict_batch}x{args.predict_seq_len} tokens/rank, bf16 params, fp32 "
              f"reduce, world 8, traced in {time.perf_counter() - start:.0f} s; profile {args.profile}")
        gathered = {kind: sum(tensor_bytes(n) for n in gm.graph.nodes if is_all_gather(n)) for kind, gm in graphs.items()}
        print(f"all-gathered per step and rank: {sum(gathered.values()) / 2**30:.2f} GiB "
              f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in gathered.items())}); "
              f"selective unsharding budget: {args.budget_gib if budget else 'none'} GiB")

        def ours(gm):  # the backend's scheduling passes with its default options
            return schedule_graphs({"graph": gm}, hardware_profile=cost_model)["graph"]

        def estimate_ms(node, override_size):
            facts = op_facts(node)
            if facts.collective is not None and override_size is not None:
                return 1e3 * cost_model.collective_seconds(facts.collective, override_size, facts.world)
            return 1e3 * cost_model.seconds(facts)

        def inductor(gm):
            # Its own compute estimator needs triton (absent on CPU); it gets our cost model's
            # numbers for every node instead, the same numbers our passes schedule with.
            with unittest.mock.patch.object(overlap_scheduling, "estimate_roofline_runtime_ms", lambda node: 0.0):
                # Its bucketing makes ops our simulator does not model; compare the reordering alone.
                return schedule_overlap_bucketing(gm, custom_runtime_estimation=estimate_ms, collective_bucketing=False,
                                                  pre_bucketing_fsdp_collectives=False, compute_estimator="analytical")

        schedules = {"unscheduled": lambda gm: gm, "fsdp_graph": ours, "Inductor in-tree": inductor}
        totals = {}
        drawn = ({}, {})  # our schedule's programs and simulations, for --timeline and --trace
        for name, schedule in schedules.items():
            total = exposed = 0.0
            peaks = []
            for kind, gm in graphs.items():
                try:
                    program = program_of(schedule(copy.deepcopy(gm)))
                    sim = simulate(program, cost_model)
                    if name == "fsdp_graph":
                        drawn[0][f"llama3_8b.{kind}"], drawn[1][f"llama3_8b.{kind}"] = program, sim
                except Exception as error:
                    print(f"  {name} {kind}: failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
                    break
                total += sim.total_s
                exposed += sim.exposed_comm_s
                peaks.append(sim.memory.peak_bytes)
                print(f"  {name:18} {kind:9} step {sim.total_s * 1e3:8.1f} ms  comm {sim.comm_s * 1e3:7.1f} ms  "
                      f"exposed {sim.exposed_comm_s * 1e3:7.2f} ms ({100 * sim.exposed_fraction:5.2f}%)  "
                      f"collectives {len(sim.collectives):3d}  peak {sim.memory.peak_bytes / 2**30:6.2f} GiB")
                if name != "unscheduled":
                    print(f"{'':31}{exposed_at(sim)}")
            else:
                totals[name] = (total, exposed, peaks)
        for name, (total, exposed, peaks) in totals.items():
            print(f"{name:18} step {total * 1e3:8.1f} ms, exposed comm {exposed * 1e3:7.2f} ms = {100 * exposed / total:.2f}% of the step, "
                  f"peak {' / '.join(f'{p / 2**30:.2f}' for p in peaks)} GiB")
        if args.markdown:
            header = ["schedule", "step ms", "exposed communication ms", "share of the step", "peak GiB (forward / backward)"]
            table = [[name, f"{total * 1e3:.1f}", f"{exposed * 1e3:.2f}", f"{100 * exposed / total:.2f}%",
                      " / ".join(f"{p / 2**30:.2f}" for p in peaks)] for name, (total, exposed, peaks) in totals.items()]
            caption = (f"Predicted on one CPU process: Llama-3-8B shape ({num_params / 1e9:.2f}B parameters, full multi-head "
                       f"attention), traced whole at world size 8 on the fake process group with meta tensors, "
                       f"{args.predict_batch}x{args.predict_seq_len} tokens per rank, bf16 parameters, fp32 reduction, "
                       f"profile {args.profile}; {sum(gathered.values()) / 2**30:.2f} GiB all-gathered per step and rank; "
                       f"selective unsharding budget: {f'{args.budget_gib} GiB' if budget else 'none'}.")
            print(f"markdown: {write_markdown(args.markdown, 'Predicted, Llama-3-8B shape', [(caption, header, table)])}")
        if args.timeline:
            print(f"timeline: {write_timeline(args.timeline, drawn[1])}")
        if args.trace:
            print(f"trace: {write_trace(args.trace, drawn[1], drawn[0])}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.predict_8b:
        predict_8b(arguments)
    else:
        timings(arguments)
