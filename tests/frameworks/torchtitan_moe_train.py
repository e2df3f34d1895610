"""torchtitan's Trainer on an MoE debug model with expert parallelism, a few steps on gloo ranks.

    python -m torch.distributed.run --standalone --nproc-per-node {2,4} tests/frameworks/torchtitan_moe_train.py \
        {torch,ours} {qwen3_moe_debug,deepseek_v3_debugmodel} EP_DEGREE DP_SHARD_DEGREE ASSETS_DIR \
        {eager,whole,whole-inductor}[+chunks] [SAVE_TO]

`ours` makes torchtitan use fsdp_graph's `fully_shard` (`fsdp_graph.use_in_place_of_torch_fsdp()`);
`whole` then compiles the model's whole step with the fsdp_graph backend (aot_eager), `whole-inductor`
with its default compiler, and the result names the groups that ran on the eager hooks instead.
For `torch`, `whole` and `whole-inductor` compile with torch.compile's own aot_eager and inductor.
`+chunks`: every MoE layer runs on two slices of its tokens (`fsdp_graph.run_in_chunks`, both impls).
Rank 0 prints every step's loss and a digest of every final parameter and buffer (the full tensors,
gathered on every rank), and saves the full parameters to SAVE_TO if given. See docs/frameworks/torchtitan.md.
"""

import hashlib
import json
import os
import sys

import torch

# The CPU stand-ins live beside the examples, which use them too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import torchtitan_on_cpu  # noqa: E402

impl, model_name, ep_degree, dp_shard_degree, assets, mode = sys.argv[1:7]
mode, chunks = mode.removesuffix("+chunks"), mode.endswith("+chunks")
if impl == "ours" or chunks:
    import fsdp_graph
if impl == "ours":
    fsdp_graph.use_in_place_of_torch_fsdp()
torchtitan_on_cpu.prepare()

from torchtitan.tools.logging import init_logger  # noqa: E402

init_logger()
config = torchtitan_on_cpu.moe_debug_config(
    model_name, os.path.join(assets, os.environ["RANK"]), layers=2, seq_len=32, batch=2, steps=3,
    expert_parallel_degree=int(ep_degree), data_parallel_shard_degree=int(dp_shard_degree),
)
if mode != "eager":
    # torch.compile of torchtitan's MoE layer under its selective activation checkpointing trains
    # otherwise than eager torch, with no FSDP at all (the experts' load-balancing bias moves
    # differently from the first step: docs/frameworks/torchtitan.md), so compiled runs leave
    # checkpointing off and compare with eager torch bit for bit.
    config.activation_checkpoint = None
trainer = config.build()
if chunks:
    for block in trainer.model_parts[0].layers.values():
        if getattr(block, "moe", None) is not None:
            fsdp_graph.run_in_chunks(block.moe, 2, dim=1)  # (batch, sequence, dim): slices of the sequence
if impl == "torch":
    for part in trainer.model_parts:
        torchtitan_on_cpu.sum_reductions_for_gloo(part)
if mode != "eager":
    # The token dispatcher's all-to-all splits come from `.tolist()` of routing counts: traced as
    # numbers of the graph (unbacked) instead of a graph break at every MoE layer.
    torch._dynamo.config.capture_scalar_outputs = True
    compiler = "aot_eager" if mode == "whole" else "inductor"
    dump_dir = os.path.join(assets, "dump", os.environ["RANK"])
    backend = compiler if impl == "torch" else fsdp_graph.backend(compiler=compiler, dump_dir=dump_dir)
    trainer.model_parts[0].compile(backend=backend)
losses = torchtitan_on_cpu.record_losses(trainer)
trainer.train()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().contiguous()


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


model = trainer.model_parts[0]
full_params = {name: full(p) for name, p in model.named_parameters()}  # every rank gathers
params = {name: digest(p) for name, p in full_params.items()}
buffers = {name: digest(full(b)) for name, b in model.named_buffers()}
# How the expert weights were sharded: their mesh's dimension names and placements (expert parallel or not).
experts = sorted({
    f"{p.device_mesh.mesh_dim_names} {p.placements}" for name, p in model.named_parameters() if "routed_experts" in name
})
# The groups whose collectives the compiled graphs hold (ours), from the backend's summary.
summary = os.path.join(assets, "dump", os.environ["RANK"], "summary.json")
traced_groups = sorted({c["group"] for g in json.load(open(summary))["graphs"].values() for kind in ("forward", "backward")
                        for c in g[kind]["collectives"]}) if impl == "ours" and mode != "eager" else []
# Per compiled graph (ours), the slice of each all-to-all in the order the scheduled graph issues them.
slices = []
if impl == "ours" and mode != "eager" and chunks:
    from fsdp_graph.inspect.timeline import load_programs

    of = {c["name"]: c.get("chunk") for g in json.load(open(summary))["graphs"].values() for kind in ("forward", "backward")
          for c in g[kind]["collectives"] if c["op"] == "all_to_all_single"}
    slices = [[of[op.name] for op in program if op.name in of] for program in load_programs(os.path.dirname(summary)).values()]
graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
state = getattr(model, "_fsdp_state", None)
fallbacks = dict(getattr(state.ctx, "fallbacks", {})) if state is not None and state.ctx is not None else {}
if torch.distributed.get_rank() == 0:
    if len(sys.argv) > 7:
        torch.save(full_params, sys.argv[7])
    sharded_by = type(model).__mro__[1].__module__
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": sharded_by, "params": params, "buffers": buffers,
                                 "experts": experts, "fallbacks": fallbacks, "graph_breaks": graph_breaks, "traced_groups": traced_groups,
                                 "slices": slices}), flush=True)
