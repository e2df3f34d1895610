"""torchtitan's Trainer on an MoE debug model with expert parallelism, eager, a few steps on gloo ranks.

    python -m torch.distributed.run --standalone --nproc-per-node {2,4} tests/frameworks/torchtitan_moe_train.py \
        {torch,ours} {qwen3_moe_debug,deepseek_v3_debugmodel} EP_DEGREE DP_SHARD_DEGREE ASSETS_DIR [SAVE_TO]

`ours` makes torchtitan use fsdp_graph's `fully_shard` (`fsdp_graph.use_in_place_of_torch_fsdp()`).
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

impl, model_name, ep_degree, dp_shard_degree, assets = sys.argv[1:6]
if impl == "ours":
    import fsdp_graph

    fsdp_graph.use_in_place_of_torch_fsdp()
torchtitan_on_cpu.prepare()

from torchtitan.tools.logging import init_logger  # noqa: E402

init_logger()
config = torchtitan_on_cpu.moe_debug_config(
    model_name, os.path.join(assets, os.environ["RANK"]), layers=2, seq_len=32, batch=2, steps=3,
    expert_parallel_degree=int(ep_degree), data_parallel_shard_degree=int(dp_shard_degree),
)
trainer = config.build()
if impl == "torch":
    for part in trainer.model_parts:
        torchtitan_on_cpu.sum_reductions_for_gloo(part)
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
if torch.distributed.get_rank() == 0:
    if len(sys.argv) > 6:
        torch.save(full_params, sys.argv[6])
    sharded_by = type(model).__mro__[1].__module__
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": sharded_by, "params": params, "buffers": buffers,
                                 "experts": experts}), flush=True)
