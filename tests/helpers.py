"""Tiny real models built in code for the tests (no downloads, no mocks)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from eaglespec.models.checkpoint import load_target
from eaglespec.models.drafter import Eagle3Drafter
from eaglespec.models.drafter_config import new_drafter_config

FAMILIES = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
}


def hf_tiny(family="llama", *, vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, seed=0, tie=False,
            max_pos=512, init_range=0.2, **kw):  # fmt: skip
    """A random HF model whose logits are spread out (init_range) so greedy ties are improbable."""
    cls, extra = FAMILIES[family]
    cfg = cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, initializer_range=init_range, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **{**extra, **kw},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return model


def save_hf(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def tiny_target(tmp_path, family="llama", dtype="fp32", **kw):
    hf = hf_tiny(family, **kw)
    d = save_hf(hf, tmp_path / f"target-{family}")
    return load_target(d, dtype=dtype), hf, d


def random_drafter(target, *, fc_norm=True, norm_output=True, draft_vocab=None, seed=1, scale=0.2):
    cfg = new_drafter_config(target.cfg, draft_vocab_size=draft_vocab, fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, scale)
    if draft_vocab is not None and draft_vocab < target.cfg.vocab_size:
        g = torch.Generator().manual_seed(seed)
        d.set_draft_vocab(torch.randperm(target.cfg.vocab_size, generator=g)[:draft_vocab])
    p = next(target.parameters())
    return d.to(p.dtype).eval().requires_grad_(False)
