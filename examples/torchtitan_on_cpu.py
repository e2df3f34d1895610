"""What torchtitan 0.3.0 needs to train on a CPU with gloo, as a user meets it (docs/frameworks/torchtitan.md).

Each function works around one thing; `prepare()` applies all of them before torchtitan is imported.
None of them touches fsdp_graph, and the reference runs with torch's `fully_shard` get the same ones.
Below them, the small run that tests/frameworks/torchtitan_train.py and examples/benchmark_torchtitan.py
both train (`debug_config`, `record_losses`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import types

import torch
import torch.nn.functional as F

_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_EP_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)
_WORDS = [f"w{i}" for i in range(200)]


def placeholder_ep_kernels() -> None:
    """`import torchtitan.models.llama3` imports the expert-parallel kernels, which `import triton`
    (a GPU package), dense models too: stand in for that one module where triton is missing."""
    if importlib.util.find_spec("triton") is not None or _EP_KERNELS in sys.modules:
        return
    module = types.ModuleType(_EP_KERNELS)

    def needs_triton(*_args, **_kwargs):
        raise NotImplementedError("torchtitan's expert-parallel kernels need triton and a GPU")

    for name in _EP_KERNEL_NAMES:
        setattr(module, name, needs_triton)
    sys.modules[_EP_KERNELS] = module


def cpu_as_the_device() -> None:
    """torchtitan takes "cuda" when no accelerator is found, and calls `torch.cuda`-style device
    functions (memory statistics, device name) that `torch.cpu` lacks."""
    import torchtitan.tools.utils as utils

    utils.device_type = "cpu"
    utils.device_module = types.SimpleNamespace(
        set_device=lambda *_: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda *_: "cpu",
        get_device_properties=lambda *_: types.SimpleNamespace(total_memory=1 << 34),
        memory_stats=lambda *_: {}, reset_peak_memory_stats=lambda *_: None, empty_cache=lambda: None,
        synchronize=lambda *_: None, memory=types.SimpleNamespace(), manual_seed=torch.manual_seed,
    )


def dense_mask(mask_mod, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The mask `mask_mod` gives, as a (batch, 1, q_len, kv_len) tensor: the mask mod called once on
    index tensors that broadcast against each other (torchtitan's mask mods compare and index
    elementwise). The same values as FlexAttention's `create_mask`, which calls it through `vmap`,
    cheaper to trace in a compiled step, where every layer makes its mask again."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_idx = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return torch.broadcast_to(mask_mod(b, h, q_idx, kv_idx), (batch, 1, q_len, kv_len))


def dense_flex_attention() -> None:
    """FlexAttention has no backward on the CPU: the same mask, made dense, through SDPA."""
    from torch.nn.attention.flex_attention import AuxOutput
    from torchtitan.models.common.attention import FlexAttention

    def attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, kernel_options=None):
        if score_mod is not None or (return_aux is not None and return_aux.lse):
            raise NotImplementedError("the CPU stand-in for FlexAttention takes a block mask only")
        mask = dense_mask(block_mask.mask_mod, q.shape[0], q.shape[2], k.shape[2], q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(attention)


def keep_timeouts() -> None:
    """After the first step torchtitan shortens the collectives' timeouts with
    `torch.distributed.set_timeout`, which torch 2.13 does not have."""
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda **_: None


def write_assets(root: str) -> tuple[str, str]:
    """A word-level tokenizer and a small text dataset in `root` (torchtitan's own test assets are
    not in its wheel): returns (tokenizer folder, dataset folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True, "add_eos_token": True}, f)
    rng = random.Random(0)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 200)))}) + "\n")
    return tokenizer_dir, data_dir


def sum_reductions_for_gloo(model: torch.nn.Module) -> None:
    """torch's `fully_shard` reduces with `PREMUL_SUM` for torchtitan's gradient divide factor, which
    gloo lacks: each of its modules sums and divides instead. fsdp_graph's needs nothing."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def prepare() -> None:
    """Every stand-in above that is needed before torchtitan's models are imported and built."""
    placeholder_ep_kernels()
    cpu_as_the_device()
    dense_flex_attention()
    keep_timeouts()


def debug_config(assets: str, *, layers: int, seq_len: int, batch: int, steps: int, spmd_backend: str):
    """torchtitan's llama3 debug model with its first `layers` layers, trained `steps` steps of
    `batch` x `seq_len` tokens per rank on the assets `write_assets` leaves in `assets` (this rank's
    folder), fp32, sharded over 2 ranks, no checkpoints, seed 0. Call after `prepare()`."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = _trained_on_cpu(llama3_debugmodel(), assets, layers=layers, seq_len=seq_len, batch=batch, steps=steps)
    config.parallelism.data_parallel_shard_degree = 2
    config.parallelism.spmd_backend = spmd_backend
    return config


def moe_debug_config(name: str, assets: str, *, layers: int, seq_len: int, batch: int, steps: int,
                     expert_parallel_degree: int, data_parallel_shard_degree: int):
    """torchtitan's MoE debug model `name` (`qwen3_moe_debug` or `deepseek_v3_debugmodel`) with its first
    `layers` layers, trained as `debug_config` trains, with expert parallelism of `expert_parallel_degree`
    over a data-parallel mesh of `data_parallel_shard_degree`. Call after `prepare()`."""
    import importlib

    family = {"qwen3_moe_debug": "qwen3", "deepseek_v3_debugmodel": "deepseek_v3"}[name]
    registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
    config = _trained_on_cpu(getattr(registry, name)(), assets, layers=layers, seq_len=seq_len, batch=batch, steps=steps)
    config.parallelism.data_parallel_shard_degree = data_parallel_shard_degree
    config.parallelism.expert_parallel_degree = expert_parallel_degree
    config.parallelism.spmd_backend = "partial_dtensor"  # the default (spmd_types) does not train on a CPU, see docs
    config.training.disable_cuda_graphs = True  # torchtitan refuses its all-to-all dispatcher under CUDA graphs
    return config


def _trained_on_cpu(config, assets: str, *, layers: int, seq_len: int, batch: int, steps: int):
    """`config` with its first `layers` layers, trained `steps` steps of `batch` x `seq_len` tokens per
    rank on the assets `write_assets` leaves in `assets`, fp32, no checkpoints, seed 0."""
    tokenizer_dir, data_dir = write_assets(assets)
    config.model_spec.model.layers = config.model_spec.model.layers[:layers]
    config.hf_assets_path = tokenizer_dir
    config.dataloader.dataset_path = data_dir
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.mixed_precision_param = "float32"
    config.checkpoint.enable = False
    config.debug.seed = 0
    config.dump_folder = os.path.join(assets, "outputs")
    return config


def record_losses(trainer) -> list:
    """The list every step's loss (the global mean) is appended to as the trainer trains."""
    losses = []
    forward_backward_step = trainer.forward_backward_step

    def recording_step(*args, **kwargs):
        loss = forward_backward_step(*args, **kwargs)
        value = loss.detach()
        losses.append((value.full_tensor() if hasattr(value, "full_tensor") else value).item())
        return loss

    trainer.forward_backward_step = recording_step
    return losses
