"""A PEFT LoRA adapter on a transformers Llama, sharded with `fully_shard` per decoder layer and at
the root, trained a few steps on 2 gloo ranks; prints the losses.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/frameworks/peft_train.py \
        {torch,ours} {eager,whole,checkpointing}

`whole`: the whole step compiled by fsdp_graph (aot_eager); `checkpointing`: HF gradient
checkpointing. See docs/frameworks/peft.md.
"""

import json
import sys

import torch

impl, mode = sys.argv[1:3]
if impl == "ours":
    import fsdp_graph

    fsdp_graph.use_in_place_of_torch_fsdp()

import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402  (the user's own import)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

dist.init_process_group("gloo")
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
if mode == "checkpointing":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
for layer in model.base_model.model.model.layers:
    fully_shard(layer)
fully_shard(model)
run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager")) if mode == "whole" else model
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
losses = []
for step in range(4):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2 * step + dist.get_rank()))
    loss = run(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / dist.get_world_size())
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"losses": losses, "sharded_by": type(model).__mro__[1].__module__}), flush=True)
