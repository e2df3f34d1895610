"""torchtitan's Trainer (llama3 debug model) for a few steps on 2 gloo ranks; prints the losses.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/frameworks/torchtitan_train.py \
        {torch,ours} {eager,whole,whole-inductor} {partial_dtensor,full_dtensor} ASSETS_DIR

`ours` makes torchtitan use fsdp_graph's `fully_shard` (`fsdp_graph.use_in_place_of_torch_fsdp()`);
`whole` compiles the whole step with the fsdp_graph backend (aot_eager), `whole-inductor` with its
default (Inductor, in pieces). See docs/frameworks/torchtitan.md.
"""

import json
import os
import sys

import torch

# The CPU stand-ins live beside the examples, which use them too (examples/benchmark_torchtitan.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import torchtitan_on_cpu  # noqa: E402

impl, mode, spmd_backend, assets = sys.argv[1:5]
if impl == "ours":
    import fsdp_graph

    fsdp_graph.use_in_place_of_torch_fsdp()
torchtitan_on_cpu.prepare()

from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

init_logger()
tokenizer_dir, data_dir = torchtitan_on_cpu.write_assets(os.path.join(assets, os.environ["RANK"]))
config = llama3_debugmodel()
# Two of the debug model's six layers: what each test here checks needs a block and the root, and the
# whole step's compile grows with depth.
config.model_spec.model.layers = config.model_spec.model.layers[:2]
config.hf_assets_path = tokenizer_dir
config.dataloader.dataset_path = data_dir
config.training.steps = 5
config.training.seq_len = 64
config.training.local_batch_size = 2
config.training.mixed_precision_param = "float32"
config.parallelism.data_parallel_shard_degree = 2
config.parallelism.spmd_backend = spmd_backend
config.checkpoint.enable = False
config.debug.seed = 0
config.dump_folder = os.path.join(assets, "outputs")
trainer = config.build()
if impl == "torch":  # gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor of 1
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
if mode == "whole":
    trainer.model_parts[0].compile(backend=fsdp_graph.backend(compiler="aot_eager"))
elif mode == "whole-inductor":
    trainer.model_parts[0].compile(backend="fsdp_graph")

losses = []
forward_backward_step = trainer.forward_backward_step


def recording_step(*args, **kwargs):
    loss = forward_backward_step(*args, **kwargs)
    value = loss.detach()
    losses.append((value.full_tensor() if hasattr(value, "full_tensor") else value).item())
    return loss


trainer.forward_backward_step = recording_step
trainer.train()
if torch.distributed.get_rank() == 0:
    sharded_by = type(trainer.model_parts[0]).__mro__[1].__module__
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": sharded_by}), flush=True)
