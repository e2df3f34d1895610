"""Predicted step of a Qwen3-235B-A22B-shaped MoE model with FSDP x expert parallelism, on a fake world.

Nothing is computed and no GPU is needed: the model is built on the meta device, sharded as torchtitan
shards it (the routed experts' weights DTensors on an "ep" mesh axis, `fully_shard` giving them a
`ShardPlacementResult` over the data-parallel ranks left after expert parallelism, "efsdp", the other
weights over all data-parallel ranks), one process stands for rank 0 of the fake world
(`fsdp_graph.predict.fake_world`), `capture_graphs` traces the step (four layers, the rest stamped
out), the backend's passes schedule it and the simulator times it on a cost model:

    python examples/predict_moe.py                                  # 94 layers, FSDP 64 x EP 8
    python examples/predict_moe.py --layers 8 --markdown moe.md     # a quicker look
    python examples/predict_moe.py --chunks 2                       # MoE layers on two slices of their tokens

The shape is Qwen3-235B-A22B's: 94 layers, hidden 4096, 64 query and 4 key-value heads of 128,
128 routed experts of hidden 1536 with the top 8 per token, vocabulary 151936; bf16 parameters, fp32
gradient reduction, activation checkpointing per layer, flash attention. Routing is taken as balanced
(every expert gets tokens x 8 / 128 of a rank's tokens), as a capture on meta tensors must: a real
router's counts come from the data, and its all-to-all splits with them. Rows: the graphs as traced,
scheduled without `overlap_all_to_alls`, and scheduled with every pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

import fsdp_graph
from fsdp_graph.passes.cost_model import CostModel
from fsdp_graph.predict import capture_graphs, fake_world, predict_step, schedule_graphs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import write_markdown  # noqa: E402


class Config:
    dim, heads, kv_heads, head_dim = 4096, 64, 4, 128
    experts, top_k, expert_hidden, vocab = 128, 8, 1536, 151936


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, 2 * c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.c.heads, self.c.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.c.kv_heads, self.c.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Experts(nn.Module):
    """The routed experts, grouped (experts first, as torchtitan's); each rank computes with its own."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(c.experts, c.dim, c.expert_hidden))
        self.w3 = nn.Parameter(torch.empty(c.experts, c.dim, c.expert_hidden))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.expert_hidden, c.dim))

    def forward(self, x):  # (local experts, rows, dim)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


class MoE(nn.Module):
    """Top-k routing with balanced counts, the tokens sent to their experts' ranks and back."""

    def __init__(self, c: Config, ep_mesh) -> None:
        super().__init__()
        self.c, self.ep_mesh = c, ep_mesh
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = Experts(c)

    def forward(self, x):
        c, shape = self.c, x.shape
        x = x.reshape(-1, c.dim)
        scores, chosen = torch.topk(torch.sigmoid(self.router(x)), c.top_k, dim=-1)
        order = chosen.flatten().argsort(stable=True)  # rows grouped by expert, balanced counts assumed
        routed = x.index_select(0, order // c.top_k).view(c.experts, -1, c.dim)
        ep, local = self.ep_mesh.size(), c.experts // self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        received = funcol.all_to_all_single_autograd(routed.contiguous(), None, None, group)
        received = received.view(ep, local, -1, c.dim).transpose(0, 1).reshape(local, -1, c.dim)
        out = self.experts(received).view(local, ep, -1, c.dim).transpose(0, 1).reshape(c.experts, -1, c.dim)
        out = funcol.all_to_all_single_autograd(out.contiguous(), None, None, group).view(-1, c.dim)
        weighted = out * scores.flatten().index_select(0, order).unsqueeze(-1)
        combined = torch.zeros_like(x).index_add(0, order // c.top_k, weighted)
        return combined.view(shape)


class Layer(nn.Module):
    def __init__(self, c: Config, ep_mesh) -> None:
        super().__init__()
        self.attention_norm, self.moe_norm = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.attention, self.moe = Attention(c), MoE(c, ep_mesh)

    def forward(self, x):
        return checkpoint(self._forward, x, use_reentrant=False)

    def _forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class Model(nn.Module):
    def __init__(self, c: Config, layers: int, ep_mesh) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Layer(c, ep_mesh) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shard(model: Model, dp, efsdp, ep, policy) -> None:
    """torchtitan's way: experts on the ep mesh, their weights sharded over efsdp, the rest over dp."""
    efsdp_info = FSDPMeshInfo(mesh=efsdp, shard_mesh_dim=0)
    for layer in model.layers:
        experts = layer.moe.experts
        for name, p in list(experts.named_parameters()):
            setattr(experts, name, nn.Parameter(distribute_tensor(p.detach(), ep, [Shard(0)])))
        owned = set(experts.parameters())
        fsdp_graph.fully_shard(layer, mesh=dp, mp_policy=policy, shard_placement_fn=lambda p, owned=owned: (
            ShardPlacementResult(placement=Shard(0), mesh_info=efsdp_info) if p in owned else None))
    fsdp_graph.fully_shard([model.norm, model.head], mesh=dp, mp_policy=policy)
    fsdp_graph.fully_shard(model, mesh=dp, mp_policy=policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=94)
    parser.add_argument("--dp", type=int, default=64, help="data-parallel ranks (the fake world)")
    parser.add_argument("--ep", type=int, default=8, help="expert-parallel degree, inside the data-parallel ranks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--profile", default="h100-infiniband")
    parser.add_argument("--trace-all", action="store_true", help="trace every layer (default: four, the rest stamped out)")
    parser.add_argument("--chunks", type=int, default=1, help="each MoE layer on this many slices of its tokens "
                        "(`fsdp_graph.run_in_chunks`): their all-to-alls in pairs, each under the other slice's experts")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args()
    c = Config()
    cost_model = CostModel(args.profile)
    policy = fsdp_graph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_world(args.dp):
        world = init_device_mesh("cpu", (args.dp,), mesh_dim_names=("fsdp",))
        sparse = world._unflatten(0, (args.dp // args.ep, args.ep), ("efsdp", "ep"))
        with torch.device("meta"):
            model = Model(c, args.layers, sparse["ep"])
        num_params = sum(p.numel() for p in model.parameters())
        shard(model, world, sparse["efsdp"], sparse["ep"], policy)
        for layer in model.layers:
            fsdp_graph.run_in_chunks(layer.moe, args.chunks, dim=1)
        # Lives through the step outside the graphs: fp32 parameter shards, their gradients, AdamW's two moments.
        resident = 4 * 4 * sum(p.to_local().numel() for p in model.parameters())
        start = time.perf_counter()
        tokens = torch.randint(0, c.vocab, (args.batch, args.seq_len), device="meta")
        graphs = capture_graphs(model, tokens, repeated_blocks=None if args.trace_all else model.layers)
        traced_s = time.perf_counter() - start
        setup = (f"Qwen3-235B-A22B shape, {args.layers} layers ({num_params / 1e9:.1f}B params), FSDP {args.dp} x EP "
                 f"{args.ep} (routed experts sharded over efsdp {args.dp // args.ep}), {args.batch}x{args.seq_len} tokens "
                 f"per rank{f' in {args.chunks} slices per MoE layer' if args.chunks > 1 else ''}, balanced routing, bf16 params, fp32 reduce, activation checkpointing per layer; {cost_model}; "
                 f"resident per rank (fp32 shards, gradients, AdamW moments) {resident / 2**30:.2f} GiB")
        print(f"{setup}; traced in {traced_s:.0f} s")
        rows = (("as traced", lambda: graphs),
                ("scheduled without overlap_all_to_alls",
                 lambda: schedule_graphs(graphs, hardware_profile=cost_model, disabled_passes={"overlap_all_to_alls"})),
                ("scheduled", lambda: schedule_graphs(graphs, hardware_profile=cost_model)))
        table = []
        for name, schedule in rows:
            start = time.perf_counter()
            step = predict_step(schedule(), cost_model, resident)
            hidden = {p: 1 - step.exposed_s_by[p] / step.comm_s[p] for p in step.comm_s if step.comm_s[p]}
            print(f"{name:40} step {step.step_s * 1e3:8.1f} ms, exposed comm {step.exposed_s * 1e3:7.1f} ms = "
                  f"{100 * step.share():.1f}%, " + ", ".join(
                      f"{p} {step.num_collectives[p]} collectives {step.comm_s[p] * 1e3:.1f} ms ({100 * hidden[p]:.0f}% hidden)"
                      for p in sorted(hidden)) +
                  f"; peak {step.peak_bytes / 2**30:.2f} GiB per rank ({step.peak_graph}) [{time.perf_counter() - start:.0f} s]")
            table.append([name, f"{step.step_s * 1e3:.1f}", f"{step.exposed_s * 1e3:.1f} ms = {100 * step.share():.1f}%",
                          *(f"{100 * step.share(p):.1f}% ({100 * hidden.get(p, 1.0):.0f}% hidden)" for p in ("fsdp", "ep")),
                          f"{step.peak_bytes / 2**30:.2f} GiB ({step.peak_graph})"])
    if args.markdown:
        header = ["schedule", "step ms", "exposed communication", "FSDP's share (hidden)", "EP's share (hidden)",
                  "peak per rank"]
        caption = f"{setup}; traced in {traced_s:.0f} s. Command: `python examples/predict_moe.py {' '.join(sys.argv[1:])}`."
        print(f"markdown: {write_markdown(args.markdown, 'Predicted, Qwen3-235B-A22B shape, FSDP x EP', [(caption, header, table)])}")


if __name__ == "__main__":
    main()
