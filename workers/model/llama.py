"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module names mirror transformers' so checkpoint names map one to one, except
that q/k/v and gate/up are fused (fewer, larger matmuls): see loader.py.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.attention import paged_attention
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.model.compiled import step_attention
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pdserve.workers.model.packed_linear import linear
from pdserve.workers.model.tensor_parallel import SINGLE, TensorParallel


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Qwen3's per-head norms of q and k (before RoPE). Not the Triton norm: that one is for
        # [rows, hidden] inputs; these are strided views of the fused q/k/v output.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        # An fp8 KV cache's K and V scales (the stored value is x / scale): 1.0, or the
        # checkpoint's calibrated `k_scale`/`v_scale` (workers/model/loader.py).
        self.kv_scales = (1.0, 1.0)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | None, kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        # Functional calls, not module calls, on the per-step path: nn.Module's
        # __call__ has a fixed cost per call (hooks, dispatch) that adds up over
        # a CPU decode step's many small calls (docs/performance.md).
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj)  # [T, q + 2 kv]
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        if self.backend is AttentionBackend.TRITON and meta is not None and kv_cache is not None and rotary.use_triton:
            from pdserve.kernels.triton_attention import rope_paged_attention  # imports triton: only when asked

            # RoPE and the KV write in one launch; the roped keys go straight into the cache.
            out = rope_paged_attention(qkv, self.num_heads, self.num_kv_heads, cos_sin[0], rotary.cos, rotary.sin,
                                       kv_cache[0], kv_cache[1], meta, self.scale, self.kv_scales)
            return linear(out, self.o_proj)
        # RoPE on q and k together: they are adjacent in the fused output.
        qk = rotary.apply(
            qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if meta is None or kv_cache is None:  # compiled: the step's cache and metadata are not graph inputs
            out = step_attention(q, k, v, self.layer_idx, self.scale, self.kv_scales)
        else:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.backend, self.kv_scales)
        return linear(out, self.o_proj)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v output with each head of q and k RMS-normalised (Qwen3), in the same
        layout: both attention paths (and the Triton kernel that ropes q and k) read it unchanged."""
        assert self.q_norm is not None and self.k_norm is not None
        t = qkv.shape[0]
        q = self.q_norm.forward(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))[0]
        k = self.k_norm.forward(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads,
                                                                                         self.head_dim))[0]
        return torch.cat((q.reshape(t, self.q_size), k.reshape(t, self.kv_size), qkv[:, self.q_size + self.kv_size :]),
                         dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp  # o_proj and down_proj are row-parallel: their outputs are summed over the ranks
        triton = backend is AttentionBackend.TRITON
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)
        self.self_attn = Attention(cfg, backend, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, triton, bias=cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward(x, residual)
        h = self.tp.all_reduce(self.self_attn.forward(h, rotary, cos_sin, meta, kv_cache))
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.tp.all_reduce(self.mlp.forward(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_first, vocab_rows = tp.vocab_shard(cfg.vocab_size)  # this rank's rows of the vocabulary
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, backend, i, tp) for i in range(cfg.num_layers)])
        triton = backend is AttentionBackend.TRITON
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, triton)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        cos_sin = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            kv_cache = None if kv_caches is None else kv_caches[i]
            x, residual = layer.forward(x, residual, self.rotary, cos_sin, meta, kv_cache)
        return self.norm.forward(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x: torch.Tensor = self.embed_tokens(input_ids)
            return x
        # Vocab-parallel: a token outside this rank's rows embeds as zeros here; the sum over
        # the ranks is its one row.
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class LlamaForCausalLM(nn.Module):
    """forward(token ids, positions, metadata, caches) -> hidden [T, hidden];
    compute_logits(hidden rows) -> float32 logits [N, vocab].

    With `tp` of more than one rank, `cfg` is this rank's shard of the model
    (tensor_parallel.shard_config) and each forward runs in step with the other ranks'."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend = AttentionBackend.TORCH,
                 max_positions: int = 2048, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, backend, max_positions, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size)[1], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """meta and kv_caches None: attention goes through the step context
        (workers/model/compiled.py), which is how the compiled graph runs."""
        hidden: torch.Tensor = self.model(input_ids, positions, meta, kv_caches)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_vocab(linear(hidden, self.lm_head).float(), self.config.vocab_size)
