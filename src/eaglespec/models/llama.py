"""Llama-family target model (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3) with EAGLE-3 aux-state capture.

Parameter names equal the `transformers` ones, so HF checkpoints load with a plain state-dict copy.
Families differ only by switches: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding window
(Mistral), tied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kv_cache import KVCache, StepMeta
from .layers import MLP, Attention, RMSNorm, Rotary, rope_tables
from .precision import attention_dtype, row_invariant_attention

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class TargetConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str

    @classmethod
    def from_hf(cls, hf) -> TargetConfig:
        family = hf.model_type
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"unsupported target architecture model_type={family!r}; eaglespec supports "
                f"{', '.join(SUPPORTED_FAMILIES)} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3)"
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        qwen2 = family == "qwen2"
        window = getattr(hf, "sliding_window", None)
        if qwen2 or family == "qwen3":  # Qwen only applies the window when use_sliding_window is set
            window = window if getattr(hf, "use_sliding_window", False) else None
        return cls(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(getattr(hf, "attention_bias", False)),
            o_bias=(not qwen2) and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            hidden_act=getattr(hf, "hidden_act", "silu"),
        )

    def aux_layers(self, given: tuple[int, ...] | None) -> tuple[int, ...]:
        """The given aux layer ids, checked against the layer count, or the default ones when None."""
        layers = tuple(given) if given else self.default_aux_layers()
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for a {self.num_layers}-layer target")
        return layers

    def default_aux_layers(self) -> tuple[int, ...]:
        """EAGLE-3 default: residual stream at the inputs of layers 2, L//2 and L-3."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaTarget(nn.Module):
    """forward(ids, positions, cache, meta) -> (final normed hidden [B,T,H], aux [B,T,A*H])."""

    def __init__(self, cfg: TargetConfig, hf_config=None, aux_layers: tuple[int, ...] | None = None):
        super().__init__()
        self.cfg = cfg
        self.hf_config = hf_config
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if hf_config is not None:
            inv_freq, scaling = rope_tables(hf_config)
        else:
            inv_freq, scaling = (
                1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)),
                1.0,
            )
        self.rotary = Rotary(inv_freq, scaling)
        self.set_aux_layers(aux_layers)

    def set_aux_layers(self, aux_layers: tuple[int, ...] | None) -> None:
        self.aux_layers = self.cfg.aux_layers(aux_layers)

    def new_cache(self, num_slots: int, *, max_length: int | None = None, initial_capacity: int = 256):
        p = next(self.parameters())
        exact = row_invariant_attention(p)
        return KVCache(
            self.cfg.num_layers,
            num_slots,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            max_length=max_length or self.cfg.max_position_embeddings,
            # without the row-invariant kernel: fp64 for quantized targets on CPU (precision.attention_dtype)
            dtype=torch.float32 if exact else attention_dtype(self, p.dtype, p.device),
            device=p.device,
            initial_capacity=initial_capacity,
            sliding_window=self.cfg.sliding_window,
            row_invariant=exact,
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, ids, positions, cache: KVCache, meta: StepMeta, *, capture_aux: bool = True,
                last_only: bool = False):
        """last_only: the caller reads logits of each row's last real token only (a prefill chunk); a
        runtime that computes logits in its forward (models/llamacpp/) uses it, this one returns hidden
        states for every token either way."""
        x = self.model.embed_tokens(ids)
        cos, sin = self.rotary(positions, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if capture_aux and i in self.aux_layers:
                captured[i] = x  # residual stream at the layer's input, un-normalised
            x = layer(x, cos, sin, cache, i, meta)
        h = self.model.norm(x)
        aux = torch.cat([captured[i] for i in self.aux_layers], dim=-1) if capture_aux else None
        return h, aux

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)
