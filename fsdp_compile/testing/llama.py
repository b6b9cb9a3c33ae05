"""A small Llama-style decoder (RMSNorm, RoPE attention, SwiGLU, tied embedding/output weights)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "Block", "Llama", "LlamaConfig", "LLAMA_0_95B", "LLAMA_8B", "LLAMA_TESTS", "LLAMA_TINY", "init_weights", "save_matmuls",
]

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy (as torchtitan's per-op one): keep the matmuls' outputs, recompute
    the rest (norms, activations, casts) in backward."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool = True
    checkpoint_blocks: bool = False
    """Recompute each block in backward (``torch.utils.checkpoint``, non-reentrant)."""
    checkpoint_policy: Callable[..., Any] | None = None
    """With ``checkpoint_blocks``: selective checkpointing, ``policy(ctx, op, *args, **kwargs)`` ->
    ``torch.utils.checkpoint.CheckpointPolicy`` (``create_selective_checkpoint_contexts``)."""


LLAMA_TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=48, max_seq_len=16)
"""4 units plus the root: the example, the benchmark's CPU smoke runs."""

LLAMA_TESTS = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=48, max_seq_len=16)
"""``LLAMA_TINY`` with 2 blocks: 3 units with the root (a first, a middle and a last one to gather), the test
suite's model. Every test compiles it, most on several ranks, in time about proportional to the blocks."""

LLAMA_0_95B = LlamaConfig(
    vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq_len=2048, tie_embeddings=False
)
"""The benchmark's 0.95B configuration: 16 blocks of 51.4M parameters, untied 65.5M embedding and output."""

LLAMA_8B = LlamaConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, max_seq_len=8192, tie_embeddings=False
)
"""Llama 3.1 8B's shape with full multi-head attention (8.8B parameters: 32 blocks of 243M, untied 525M
embedding and output): the 8B-class point of the benchmark, as torchtitan's published 8-GPU table."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

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


def _rope_tables(cfg: LlamaConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.dim // cfg.n_heads
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def init_weights(module: nn.Module) -> None:
    """Initialise one submodule's own parameters and buffers as Llama's constructor does (it calls this on each),
    so that, as :func:`fsdp_compile.init_parameters`'s ``init_fn``, a model built on the meta device is initialised
    as one built on a device."""
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Llama):
            for buffer, value in zip((module.rope_cos, module.rope_sin), _rope_tables(module.cfg, module.rope_cos.device)):
                buffer.copy_(value)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            init_weights(module)  # the one definition of this model's initialisation: init_parameters uses it too

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` are given."""
        s = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)
        for layer in self.layers:
            if self.cfg.checkpoint_blocks and self.cfg.checkpoint_policy is None:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            elif self.cfg.checkpoint_blocks:  # (Dynamo takes context_fn as a partial, not as a plain function)
                context = partial(create_selective_checkpoint_contexts, self.cfg.checkpoint_policy)
                x = checkpoint(layer, x, cos, sin, use_reentrant=False, context_fn=context)
            else:
                x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
