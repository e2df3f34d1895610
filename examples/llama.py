"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU) used by the examples and tests.

Plain PyTorch, nothing sharded here: `train_llama.py` shows how to apply `fully_shard` to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    """Attributes:
    vocab_size: tokens in the vocabulary.
    dim: model width.
    num_layers: decoder blocks.
    num_heads: attention heads (dim must divide by it).
    hidden_dim: SwiGLU hidden width.
    max_seq_len: longest sequence the rotary table covers.
    num_kv_heads: key/value heads (grouped-query attention, as Llama 3); None: num_heads.
    checkpoint_blocks: activation checkpointing per block (`torch.utils.checkpoint`): forward keeps
        only each block's input, backward runs the block's forward again.
    flash_attention: call torch's flash attention op (`aten._scaled_dot_product_flash_attention`)
        instead of `F.scaled_dot_product_attention`, for predictions traced on the meta device: there
        SDPA always takes the math path and holds [batch, heads, seq, seq] scores that a GPU's flash
        kernel never materializes (it saves the output and the logsumexp). The op exists for CUDA
        and meta tensors only; on CPU leave this off (SDPA picks a CPU flash kernel itself).
    """

    vocab_size: int = 256
    dim: int = 128
    num_layers: int = 8
    num_heads: int = 4
    hidden_dim: int = 344
    max_seq_len: int = 128
    num_kv_heads: int | None = None
    checkpoint_blocks: bool = False
    flash_attention: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} must be divisible by num_heads={self.num_heads}")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary_tables(head_dim: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.flash_attention = cfg.flash_attention
        kv_dim = cfg.dim // cfg.num_heads * (cfg.num_kv_heads or cfg.num_heads)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv give this rank's heads only.
        shape = (batch, seq, -1, dim // self.num_heads)
        q = _rotate(self.wq(x).view(shape), cos, sin).transpose(1, 2)
        k = _rotate(self.wk(x).view(shape), cos, sin).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        if self.flash_attention:  # key/value heads stay grouped: the kernel reads them per query group
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _rotary_tables(cfg.dim // cfg.num_heads, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (they are not in the state dict), e.g. after `to_empty`."""
        cos, sin = _rotary_tables(self.cfg.dim // self.cfg.num_heads, self.cfg.max_seq_len)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.cfg.checkpoint_blocks:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))


def llama_config(dim: int, num_layers: int, max_seq_len: int) -> LlamaConfig:
    """The examples' and benchmarks' model: width `dim`, SwiGLU hidden width 8/3 of it."""
    return LlamaConfig(dim=dim, num_layers=num_layers, hidden_dim=dim * 8 // 3, max_seq_len=max_seq_len)


def shard_llama(model: Llama, fully_shard, **kwargs) -> Llama:
    """Apply `fully_shard` the usual way: one group per block, then the root (embedding, norm, head)."""
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
