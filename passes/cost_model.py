"""How long graph nodes take on a given machine: collectives by latency and bandwidth, compute by roofline.

Two halves, so that a dump from a CPU run can be replayed on a GPU profile:
- `op_facts(node)` reads what the node does, independent of any machine: FLOPs (torch's own FLOP
  formulas, `torch.utils.flop_counter`, applied to the fake tensors in `node.meta["val"]`), bytes
  read and written, and for a collective its kind, bytes and world size;
- `CostModel(profile)` turns those facts into seconds.

    collective:  latency + factor(kind, world) * bytes / bus_bandwidth      (ring algorithms:
                 factor = (world-1)/world for all-gather / reduce-scatter / all-to-all (each rank
                 keeps 1/world of what it sends), twice that for all-reduce)
    compute:     launch overhead + max(flops / matmul rate, bytes / memory bandwidth)

The profiles are analytical (public peak numbers derated to what large kernels reach); `calibrate`
replaces a profile's collective and matmul numbers with measurements on the current process group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from .nodes import is_all_gather, is_all_reduce, is_all_to_all, is_reduce_scatter, is_wait_tensor, parallelism_of, region_body, size_hint, value_bytes


class CollectiveKind(Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its interconnect, for the cost model.

    Attributes:
        name: how `--profile` and `BackendConfig.hardware_profile` name it.
        matmul_flops_per_s: reachable dense matmul rate for 16-bit inputs.
        fp32_matmul_flops_per_s: the same for 32-bit inputs (TF32 on a GPU).
        memory_bytes_per_s: reachable memory bandwidth of memory-bound kernels.
        kernel_overhead_s: fixed cost of every compute kernel (launch, or a CPU op's dispatch).
        collective_latency_s: fixed cost of one collective.
        bus_bytes_per_s: ring bus bandwidth per rank of all-gather / reduce-scatter.
    """

    name: str
    matmul_flops_per_s: float
    fp32_matmul_flops_per_s: float
    memory_bytes_per_s: float
    kernel_overhead_s: float
    collective_latency_s: float
    bus_bytes_per_s: float

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in vars(self).items() if k != "name" and not (isinstance(v, (int, float)) and v >= 0)]
        rates = ("matmul_flops_per_s", "fp32_matmul_flops_per_s", "memory_bytes_per_s", "bus_bytes_per_s")
        bad += [f"{k}=0" for k in rates if getattr(self, k) == 0]
        if bad:
            raise ValueError(f"HardwareProfile {self.name!r} needs non-negative numbers and non-zero rates: {', '.join(bad)}")


class Profile(Enum):
    """Analytical profiles. Numbers: H100 SXM peaks (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3) derated
    to ~60% / ~80%; NCCL all-gather bus bandwidth ~360 GB/s inside an NVSwitch node and ~45 GB/s
    across nodes on 400 Gb/s NDR InfiniBand per GPU; the CPU row is this class of 2-core machine with
    gloo over loopback (run `calibrate` for real numbers)."""

    H100_NVLINK = HardwareProfile("h100-nvlink", 600e12, 300e12, 2.7e12, 3e-6, 15e-6, 360e9)
    H100_INFINIBAND = HardwareProfile("h100-infiniband", 600e12, 300e12, 2.7e12, 3e-6, 35e-6, 45e9)
    CPU_GLOO = HardwareProfile("cpu-gloo", 2e9, 40e9, 8e9, 8e-6, 150e-6, 2e9)

    @classmethod
    def get(cls, name: "str | HardwareProfile | Profile") -> HardwareProfile:
        """A profile by name (`"h100-nvlink"`), or the profile itself."""
        if isinstance(name, HardwareProfile):
            return name
        if isinstance(name, Profile):
            return name.value
        for member in cls:
            if member.value.name == name:
                return member.value
        raise ValueError(f"Unknown hardware profile {name!r}; choose one of {[m.value.name for m in cls]} or pass a HardwareProfile")


# -- what a node does, machine-independent ----------------------------------------------------------


@dataclass(frozen=True)
class OpFacts:
    """Machine-independent facts about one node. `collective` is None for everything else."""

    flops: int = 0
    bytes_moved: int = 0  # bytes read + written by a compute node; 0 for views and collectives
    matmul_dtype_bytes: int = 4  # element size of a matmul's inputs, which picks the FLOP rate
    collective: Optional[CollectiveKind] = None
    collective_bytes: int = 0  # the large side: all-gather output, reduce-scatter input
    world: int = 1
    parallelism: str = "fsdp"  # whose collective: "fsdp", or e.g. "tp" (`nodes.parallelism_of`)
    parts: tuple["OpFacts", ...] = ()  # a compile region's call: the facts of each node of its body


def is_view(node: Node) -> bool:
    """True if `node`'s output aliases an input (per the op schema): it costs no time and no memory."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if is_wait_tensor(node):
        return False
    returns = node.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _unwrap_rng(node: Node) -> tuple[Any, tuple, Any]:
    """(op, its arguments, its output value) of `node`, looking through the RNG-state wrappers that
    the partitioner puts around a random op (flash attention counts as one: it can drop out) which
    activation checkpointing recomputes: `run_and_save_rng_state(op, *args)` -> (state, out) in
    forward, `run_with_rng_state(state, op, *args)` -> out in backward."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    val = node.meta.get("val")
    if node.target is run_and_save_rng_state:
        return node.args[0], node.args[1:], val[1] if isinstance(val, (tuple, list)) else val
    if node.target is run_with_rng_state:
        return node.args[1], node.args[2:], val
    return node.target, node.args, val


def _flops(node: Node) -> tuple[int, int]:
    """(FLOPs, element size of the first input) from torch's FLOP formulas; (0, 4) if it has none."""
    from torch.utils.flop_counter import flop_registry

    target, node_args, out_val = _unwrap_rng(node)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0, 4
    to_val = lambda a: a.meta.get("val") if isinstance(a, Node) else a  # noqa: E731
    args = pytree.tree_map(to_val, node_args)
    kwargs = pytree.tree_map(to_val, node.kwargs)
    first = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
    try:
        flops = size_hint(formula(*args, out_val=out_val, **kwargs))  # [Note: Plans from size hints]
    except Exception:  # a formula that cannot read these shapes: treat as memory-bound
        return 0, 4
    return flops, (first.element_size() if first is not None else 4)


def op_facts(node: Node) -> OpFacts:
    """What `node` does. Placeholders, outputs, views and waits have empty facts."""
    if node.op != "call_function" or is_wait_tensor(node) or is_view(node):
        return OpFacts()
    kind = (
        CollectiveKind.ALL_GATHER if is_all_gather(node)
        else CollectiveKind.REDUCE_SCATTER if is_reduce_scatter(node)
        else CollectiveKind.ALL_REDUCE if is_all_reduce(node)
        else CollectiveKind.ALL_TO_ALL if is_all_to_all(node)
        else None
    )
    if kind is not None:
        inp, out = value_bytes(node.args[0].meta.get("val")), value_bytes(node.meta.get("val"))
        if kind is CollectiveKind.ALL_GATHER:
            world = int(node.args[1])  # all_gather_into_tensor(input, group_size, group_name)
        elif kind is CollectiveKind.REDUCE_SCATTER:
            world = int(node.args[2])  # reduce_scatter_tensor(input, op, group_size, group_name)
        elif kind is CollectiveKind.ALL_REDUCE:
            world = _group_size(node.args[2])  # all_reduce(input, op, group_name)
        else:
            world = _group_size(node.args[3])  # all_to_all_single(input, output_splits, input_splits, group_name)
        return OpFacts(collective=kind, collective_bytes=max(inp, out), world=world, parallelism=parallelism_of(node))
    body = region_body(node)  # costed as the sum of its nodes
    if body is not None:
        return OpFacts(parts=tuple(op_facts(n) for n in body.graph.nodes))
    flops, dtype_bytes = _flops(node)
    moved = value_bytes(node.meta.get("val")) + sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return OpFacts(flops=flops, bytes_moved=moved, matmul_dtype_bytes=dtype_bytes)


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()
    except Exception:  # the group is gone (a dump replayed later): an HSDP replicate pair
        return 2


# -- seconds on a machine -----------------------------------------------------------------------------


class CostModel:
    """Seconds for `OpFacts` on one `HardwareProfile`.

    `links` gives the collectives of another parallelism their own interconnect: with
    `CostModel("h100-infiniband", links={"tp": "h100-nvlink"})` FSDP's collectives cross nodes
    while tensor parallelism's stay inside one. Compute always uses `profile`.
    """

    def __init__(self, profile: "str | HardwareProfile | Profile", links: Optional[dict[str, Any]] = None) -> None:
        self.profile = Profile.get(profile)
        self.links = {parallelism: Profile.get(p) for parallelism, p in (links or {}).items()}

    def __repr__(self) -> str:
        links = "".join(f", {k}={v.name}" for k, v in self.links.items())
        return f"CostModel({self.profile.name}{links})"

    def collective_seconds(self, kind: CollectiveKind, num_bytes: int, world: int, parallelism: str = "fsdp") -> float:
        p = self.links.get(parallelism, self.profile)
        if world <= 1:
            return p.collective_latency_s
        factor = (world - 1) / world * (2 if kind is CollectiveKind.ALL_REDUCE else 1)
        return p.collective_latency_s + factor * num_bytes / p.bus_bytes_per_s

    def compute_seconds(self, flops: int, bytes_moved: int, matmul_dtype_bytes: int = 4) -> float:
        p = self.profile
        if not flops and not bytes_moved:
            return 0.0
        rate = p.fp32_matmul_flops_per_s if matmul_dtype_bytes >= 4 else p.matmul_flops_per_s
        return p.kernel_overhead_s + max(flops / rate, bytes_moved / p.memory_bytes_per_s)

    def seconds(self, facts: OpFacts) -> float:
        if facts.parts:
            return sum(self.seconds(part) for part in facts.parts)
        if facts.collective is not None:
            return self.collective_seconds(facts.collective, facts.collective_bytes, facts.world, facts.parallelism)
        return self.compute_seconds(facts.flops, facts.bytes_moved, facts.matmul_dtype_bytes)

    def is_latency_bound(self, kind: CollectiveKind, num_bytes: int, world: int) -> bool:
        """True when a collective's fixed latency is at least its transfer time: merging pays."""
        latency = self.profile.collective_latency_s
        return self.collective_seconds(kind, num_bytes, world) - latency <= latency


def calibrate(group=None, base: "str | HardwareProfile | Profile" = Profile.CPU_GLOO, sizes=(1 << 12, 1 << 22), repeats: int = 5) -> HardwareProfile:
    """Measure all-gather latency and bandwidth on `group` (default: the world) and this process's
    fp32 matmul rate; returns `base` with those numbers replaced. Every rank must call it, and every
    rank gets the same profile (the slowest rank's times, agreed with an all-reduce MAX).
    Takes about a second on 2 CPU ranks."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    times = []
    for numel in sizes:
        shard = torch.zeros(numel // world)
        out = torch.empty(numel)
        dist.all_gather_into_tensor(out, shard, group=group)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_gather_into_tensor(out, shard, group=group)
        times.append((time.perf_counter() - start) / repeats)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    matmul_s = (time.perf_counter() - start) / repeats
    measured = torch.tensor(times + [matmul_s], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    (small_s, large_s, matmul_s) = measured.tolist()
    factor = (world - 1) / world
    bytes_small, bytes_large = sizes[0] * 4, sizes[1] * 4
    bus = factor * (bytes_large - bytes_small) / max(large_s - small_s, 1e-9)
    latency = max(small_s - factor * bytes_small / bus, 0.0)
    base = Profile.get(base)
    return replace(
        base,
        name=f"{base.name}-calibrated",
        collective_latency_s=latency,
        bus_bytes_per_s=bus,
        fp32_matmul_flops_per_s=2 * 256**3 / max(matmul_s, 1e-9),
    )
