"""Hugging Face Accelerate's FSDP2 plugin training a transformers Llama for a few steps on 2 gloo
ranks; prints the losses.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/frameworks/accelerate_train.py \
        {torch,ours} {plain,ram_efficient,whole,accumulate,whole_accumulate} MODEL_DIR

`ram_efficient`: `cpu_ram_efficient_loading=True` (rank 0 loads the weights, the others a meta model,
and `prepare` broadcasts them into the shards with `load_state_dict(assign=True)`); `whole`: the
prepared model compiled in place by fsdp_graph (aot_eager); `accumulate`: two micro-batches per
optimizer step under `accelerator.accumulate` (the first without gradient sync), and
`whole_accumulate` that compiled as `whole`. Besides the losses, rank 0 prints a digest of the
final parameters, the number of graphs Dynamo compiled and fsdp_graph's warnings.
See docs/frameworks/accelerate.md.
"""

import hashlib
import json
import logging
import os
import sys

import torch
from torch._dynamo.utils import counters

impl, mode, model_dir = sys.argv[1:4]
if impl == "ours":
    import fsdp_graph

    fsdp_graph.use_in_place_of_torch_fsdp()

from accelerate import Accelerator  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    cpu_ram_efficient_loading=mode == "ram_efficient",
    auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
)
num_micro = 2 if mode.endswith("accumulate") else 1
accelerator = Accelerator(fsdp_plugin=plugin, cpu=True, gradient_accumulation_steps=num_micro)
# Accelerate turns FSDP on for accelerator devices only; on a CPU its state says MULTI_CPU (DDP).
# Set in the process-wide state too: every `AcceleratorState()` (`prepare` makes some) copies it
# back, and `accumulate()` without it turns no gradient sync off.
accelerator.state.distributed_type = DistributedType.FSDP
accelerator.state.fsdp_plugin = plugin
PartialState().distributed_type = DistributedType.FSDP
if accelerator.is_main_process and not os.path.exists(os.path.join(model_dir, "config.json")):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
accelerator.wait_for_everyone()

model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
if mode.startswith("whole"):
    model.compile(backend=fsdp_graph.backend(compiler="aot_eager"))


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


warnings_seen = _Warnings()
logging.getLogger("fsdp_graph").addHandler(warnings_seen)
losses = []
for step in range(4 * num_micro):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2 * step + accelerator.process_index))
    with accelerator.accumulate(model):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), "mean").item())
params = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
if accelerator.is_main_process:
    print("RESULT " + json.dumps({
        "losses": losses, "sharded_by": type(model).__mro__[1].__module__,
        "params": hashlib.sha256(params.detach().numpy().tobytes()).hexdigest(),
        "graphs": counters["stats"]["unique_graphs"], "warnings": warnings_seen.messages,
        "fsdp2": accelerator.is_fsdp2,
    }), flush=True)
