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

from torchtitan.tools.logging import init_logger  # noqa: E402

init_logger()
# Two of the debug model's six layers: what each test here checks needs a block and the root, and the
# whole step's compile grows with depth.
config = torchtitan_on_cpu.debug_config(os.path.join(assets, os.environ["RANK"]), layers=2, seq_len=64, batch=2,
                                        steps=5, spmd_backend=spmd_backend)
trainer = config.build()
if impl == "torch":
    for part in trainer.model_parts:
        torchtitan_on_cpu.sum_reductions_for_gloo(part)
if mode == "whole":
    trainer.model_parts[0].compile(backend=fsdp_graph.backend(compiler="aot_eager"))
elif mode == "whole-inductor":
    trainer.model_parts[0].compile(backend="fsdp_graph")

losses = torchtitan_on_cpu.record_losses(trainer)
trainer.train()
if torch.distributed.get_rank() == 0:
    sharded_by = type(trainer.model_parts[0]).__mro__[1].__module__
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": sharded_by}), flush=True)
