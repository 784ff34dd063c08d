"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Linear layers are plain nn.Linear modules so that a weight-only quantizer can swap them.
Numerics follow the `transformers` Llama implementation (norm in fp32, RoPE tables in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kv_cache import KVCache, StepMeta
from . import row_attention

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # fused: same math, half the time
        if dtype in (torch.float16, torch.bfloat16):  # normalise in fp32 as transformers does, fused
            return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for a HF config, computed by `transformers` itself
    (default, linear, llama3, yarn, ... rope types)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") == "dynamic":
        raise ValueError("rope_type 'dynamic' changes with sequence length and is not supported")
    rotary = LlamaRotaryEmbedding(hf_config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


class Rotary(nn.Module):
    """RoPE for arbitrary positions: tables are computed per step from the positions, so there is no
    precomputed cache whose length could be exceeded (no cliff at max_position_embeddings).

    Returns (cos, signed_sin) with signed_sin = [-sin, sin] over the two halves, so that apply_rope is
    x * cos + roll(x, half) * signed_sin: the same products and sums as `transformers`'
    x * cos + rotate_half(x) * sin (bit-identical), in fewer kernel launches."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/signed_sin: [B, T, hd] from Rotary."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None]


class Attention(nn.Module):
    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=o_bias)
        if qk_norm_eps is not None:  # Qwen3: RMSNorm over each head before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, hd] and k, v [B, kv_heads, T, hd], RoPE applied to q and k."""
        b, t, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        fused = getattr(self, "_qkv", None)
        if fused is not None:  # one matmul for q, k and v (models/fast_linear.py)
            y = fused(x).view(b, t, nh + 2 * nkv, hd).transpose(1, 2)
            v = y[:, nh + nkv :]
            if not hasattr(self, "q_norm"):  # RoPE on q and k in one pass
                qk = apply_rope(y[:, : nh + nkv], cos, sin)
                return qk[:, :nh], qk[:, nh:], v
            q, k = y[:, :nh], y[:, nh : nh + nkv]
        else:
            q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)
            k = self.k_proj(x).view(b, t, nkv, hd).transpose(1, 2)
            v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, heads, T, hd] -> o_proj output [B, T, out_dim]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x, cos, sin, cache: KVCache, layer: int, meta: StepMeta) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if cache.row_invariant and q.shape[2] <= row_attention.MAX_ROWS:  # a row's bits whatever the step holds
            cache.write(layer, meta, k.to(cache.dtype), v.to(cache.dtype))
            rows = torch.arange(q.shape[0]) if meta.rows is None else meta.rows
            out = row_attention.attend(q.to(cache.dtype), cache.k[layer], cache.v[layer], rows, meta.start, meta.span,
                                       meta.mask)  # fmt: skip
            return self.out(out.to(x.dtype))
        # SDPA (no kernel, or a long prefill chunk). The cache's precision is the attention's: without the kernel,
        # fp64 for quantized targets on CPU (precision.attention_dtype), whose tree and plain steps must round
        # attention outputs to the same fp32 bits
        keys, values = cache.write_and_read(layer, meta, k.to(cache.dtype), v.to(cache.dtype))
        out = F.scaled_dot_product_attention(
            q.to(cache.dtype), keys, values, attn_mask=meta.mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.out(out.to(x.dtype))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self, "_gate_up", None)
        if fused is not None:  # one matmul for gate and up (models/fast_linear.py)
            gate, up = fused(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
