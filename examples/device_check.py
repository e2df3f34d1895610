"""Train the example Llama with fsdp_graph, torch's fully_shard and an unsharded model side by side on
the machine at hand, and print how far apart they end up: the check to run first on a GPU machine.

    torchrun --nproc-per-node 2 examples/device_check.py                     # CPU: gloo
    torchrun --nproc-per-node 1 examples/device_check.py --dim 1024 --seq-len 1024   # one GPU: NCCL
    ... --configs fp32,bf16 --modes eager --profile                          # also where the time goes

Per config (fp32; bf16: bf16 parameters, fp32 reduction; offload: CPU offload, pinned on CUDA; zero2:
reshard_after_forward=False; unused: fp32 with a parameter in every block that no forward uses, so its
gradient stays None) and mode (eager; compiled: `torch.compile(model, backend="fsdp_graph")`
for ours and `torch.compile(model)` for torch's), every side starts from the same weights and takes
`--steps` AdamW steps on the same batches (each rank its own; the unsharded model takes the global
batch). Printed per row: the largest parameter difference from the unsharded model and from torch's
fully_shard, the last loss of each, the median step time of ours and torch's (after the first
steps), and CUDA's peak allocated memory of each. A row that raises prints its error and the others
still run. `--deterministic` (deterministic kernels, SDPA's math kernel) makes ours and torch's agree
bit for bit where they compute the same. With `--profile`, for one fp32 step of ours and of torch's
in each mode: the copy-in, copy-out and gradient-packing ops, the CUDA runtime calls (a
`cudaStreamSynchronize` there is the host waiting for the device), then the ops by device time.
This is a check and a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from llama import Llama, llama_config, shard_llama

from fsdp_graph import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

CONFIGS = ("fp32", "bf16", "offload", "zero2", "unused")
MODES = ("eager", "compiled")
# Ops and ranges of the copies around the collectives: ours (runtime/bucket_layout.py) and torch's.
COPY_OPS = ("copy_in", "copy_out", "pack_grads", "split_with_sizes_copy", "chunk_cat")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=8, help="AdamW steps per side")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--backend", help="process group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--profile", action="store_true", help="profile one fp32 step of ours and of torch's per mode")
    parser.add_argument("--trace-dir", help="with --profile: write each side's Chrome trace there")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (and SDPA's math kernel on CUDA), so that sides can agree bit for bit")
    args = parser.parse_args()
    args.configs, args.modes = args.configs.split(","), args.modes.split(",")
    for given, names in ((args.configs, CONFIGS), (args.modes, MODES)):
        if set(given) - set(names):
            parser.error(f"unknown {sorted(set(given) - set(names))}; choose from {names}")
    return args


def policies(config: str, device: torch.device) -> tuple[dict, dict]:
    """fully_shard's keyword arguments for `config`: (ours, torch's)."""
    if config == "bf16":
        return ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
                {"mp_policy": TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)})
    if config == "offload":
        pin = device.type == "cuda"
        return {"offload_policy": CPUOffloadPolicy(pin_memory=pin)}, {"offload_policy": TorchCPUOffloadPolicy(pin_memory=pin)}
    if config == "zero2":
        return {"reshard_after_forward": False}, {"reshard_after_forward": False}
    return {}, {}


def device_allocs(device: torch.device) -> int:
    """How often CUDA's caching allocator has asked the driver for memory (cudaMalloc) so far."""
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.type == "cuda" else 0


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Side:
    """One model, its optimizer and its step function. `loss` is the last step's loss on the global
    batch: the mean over ranks for a sharded side (equal batch sizes), the unsharded model's own."""

    def __init__(self, model: torch.nn.Module, step_fn, device: torch.device, sharded: bool = True) -> None:
        self.model, self.step_fn, self.device, self.sharded = model, step_fn, device, sharded
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self, tokens: torch.Tensor) -> None:
        sync(self.device)
        start = time.perf_counter()
        logits = self.step_fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        sync(self.device)
        self.times.append(time.perf_counter() - start)
        loss = loss.detach()
        if self.sharded:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.loss = loss.item()

    def peak_mib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else float("nan")


def build(base: Llama, shard, kwargs: dict, compiled: bool, backend: str | None):
    """A sharded copy of `base` and its step function (compiled with `backend` or the model itself)."""
    model = copy.deepcopy(base)
    shard_llama(model, shard, **kwargs)
    return model, (torch.compile(model, backend=backend) if compiled else model)


def with_unused_params(base: Llama) -> Llama:
    """`base` with a linear layer in every block that the forward never calls."""
    model = copy.deepcopy(base)
    torch.manual_seed(2)
    for layer in model.layers:
        layer.unused = torch.nn.Linear(model.cfg.dim, model.cfg.dim, device=model.output.weight.device)
    return model


def run_row(args, config: str, mode: str, base: Llama, batches, device, rank, world) -> list[object]:
    if config == "unused":
        base = with_unused_params(base)
    ours_kw, torch_kw = policies(config, device)
    compiled = mode == "compiled"
    unsharded = copy.deepcopy(base)
    reference = Side(unsharded, unsharded, device, sharded=False)
    sides = {}
    for name, shard, kw, backend in (("ours", fully_shard, ours_kw, "fsdp_graph"), ("torch", torch_fully_shard, torch_kw, "inductor")):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model, step_fn = build(base, shard, kw, compiled, backend)
        side = sides[name] = Side(model, step_fn, device)
        # Alternating the sides would share CUDA's peak counter; one side after the other keeps it apart.
        for i, tokens in enumerate(batches):
            if i == len(batches) // 2:
                mallocs = device_allocs(device)
            side.step(tokens[rank])
        side.peak = side.peak_mib()
        side.mallocs = device_allocs(device) - mallocs
    for tokens in batches:
        reference.step(torch.cat(list(tokens)))
    params = {name: [full(p) for p in side.model.parameters()] for name, side in sides.items()}
    expected = [p.detach().float().cpu() for p in reference.model.parameters()]
    diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))
    warm = min(2, args.steps - 1)
    median_ms = {name: statistics.median(side.times[warm:]) * 1e3 for name, side in sides.items()}
    return [config, mode, f"{diff(params['ours'], expected):.2e}", f"{diff(params['ours'], params['torch']):.2e}",
            f"{diff(params['torch'], expected):.2e}", f"{sides['ours'].loss:.5f}", f"{sides['torch'].loss:.5f}",
            f"{reference.loss:.5f}", f"{median_ms['ours']:.1f}", f"{median_ms['torch']:.1f}",
            f"{median_ms['ours'] / median_ms['torch']:.3f}", f"{sides['ours'].peak:.0f}", f"{sides['torch'].peak:.0f}",
            f"{sides['ours'].mallocs} / {sides['torch'].mallocs}"]


def profile(base: Llama, batches, device, rank, trace_dir, modes) -> None:
    """Device (or CPU) time by op of one fp32 step of ours and of torch's per mode, after two warm steps
    (a compiled side compiles in them)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sides = (("ours", fully_shard, "fsdp_graph"), ("torch", torch_fully_shard, "inductor"))
    for mode, (name, shard, backend) in ((mode, side) for mode in modes for side in sides):
        model, step_fn = build(base, shard, {}, mode == "compiled", backend)
        side = Side(model, step_fn, device)
        for tokens in batches[:2]:
            side.step(tokens[rank])
        with torch_profile(activities=activities) as prof:
            side.step(batches[2][rank])
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"{name}_{mode}_rank{rank}.json"))
        if rank == 0:
            key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
            total = sum(getattr(e, key) for e in events)
            inclusive = "device_time_total" if device.type == "cuda" else "cpu_time_total"
            copies = [e for e in events if any(s in e.key.lower() for s in COPY_OPS)]
            print(f"\n{name}, {mode}: step {side.times[-1] * 1e3:.1f} ms wall, {total / 1e3:.1f} ms {key}; "
                  f"copy-in, copy-out and packing ({inclusive}, nested ranges counted in each):", flush=True)
            for e in sorted(copies, key=lambda e: e.key):
                print(f"  {getattr(e, inclusive) / 1e3:9.3f} ms  {e.count:5d}  {e.key[:100]}")
            runtime = [e for e in events if e.key.startswith("cuda") and e.count]
            print("  CUDA runtime calls (CPU time):", ", ".join(
                f"{e.key} {e.count}x {e.cpu_time_total / 1e3:.2f} ms" for e in sorted(runtime, key=lambda e: -e.cpu_time_total)[:12]))
            print("  by self time:")
            for e in events[:25]:
                print(f"  {getattr(e, key) / 1e3:9.3f} ms  {e.count:5d}  {e.key[:100]}")
        del model, step_fn, side
        torch._dynamo.reset()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(args.backend or ("nccl" if use_cuda else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if use_cuda:
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    cfg = llama_config(args.dim, args.layers, args.seq_len)
    base = Llama(cfg).to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (world, args.batch_size, args.seq_len + 1), generator=gen).to(device)
               for _ in range(args.steps)]
    if rank == 0:
        print(f"torch {torch.__version__}, {world} ranks, {device.type}"
              f"{' ' + torch.cuda.get_device_name(device) if use_cuda else ''}, backend {dist.get_backend()}; "
              f"Llama dim {args.dim}, {args.layers} layers, {args.batch_size}x{args.seq_len} tokens per rank, "
              f"{args.steps} AdamW steps", flush=True)
    header = ["config", "mode", "ours-ref", "ours-torch", "torch-ref", "loss ours", "loss torch", "loss ref",
              "ms ours", "ms torch", "ours/torch", "MiB ours", "MiB torch",
              "device mallocs ours / torch, last half"]
    rows = []
    for config in args.configs:
        for mode in args.modes:
            try:
                rows.append(run_row(args, config, mode, base, batches, device, rank, world))
            except Exception:
                if rank == 0:
                    print(f"\n{config} {mode} raised:\n{traceback.format_exc()}", flush=True)
                rows.append([config, mode, "raised"] + [""] * (len(header) - 3))
            torch._dynamo.reset()
            if rank == 0:
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
    if rank == 0:
        print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        print("\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows), flush=True)
    if args.profile:
        profile(base, batches, device, rank, args.trace_dir, args.modes)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown in torch 2.13 aborts now and then; all work is done


if __name__ == "__main__":
    main()
