"""Dialect A (`LlamaForCausalLMEagle3`, models/drafter_config.py): the flat Llama config and bare
`midlayer.*` keys that vLLM, SGLang, SpecForge and EAGLE load, with every optional key those engines
read written out explicitly, so no engine falls back to a default of its own:
- `eagle_aux_hidden_state_layer_ids` at the top level (vLLM) and in `eagle_config` (SGLang, ModelOpt),
  capture-before-layer ids; the first id is never 1 for a default set, so SGLang (which shifts ids that
  start at 1 by one, PR #25454) and vLLM capture the same states;
- `num_aux_hidden_states`, `draft_vocab_size`, `target_hidden_size`;
- `fc_norm`, `norm_output` (EAGLE-3.1; both false is EAGLE-3), `norm_before_fc`, `norm_before_residual`,
  `bias` (SGLang's fc bias), `attention_bias`, `mlp_bias`, `tie_word_embeddings: false`;
- the drafter's own RoPE as `rope_theta` (+ `rope_scaling`) for readers before transformers 5 and as
  `rope_parameters` for transformers 5 (a missing rope_theta would mean 10000 to every reader).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.io import save_tensors, write_json

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def rope_parameters(cfg) -> dict:
    return {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}


def eagle3_config(src, dtype: torch.dtype) -> dict:
    cfg, ids = src.cfg, src.aux_layer_ids
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_width,
        "num_aux_hidden_states": len(ids),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "norm_before_fc": cfg.norm_before_fc,
        "norm_before_residual": cfg.norm_before_residual,
        "bias": cfg.fc_bias,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.draft_attention_window:  # ours; other engines ignore it (the export says so)
        out["draft_attention_window"] = cfg.draft_attention_window
    extra = {k: v for k, v in cfg.extra.items() if k not in out}
    return {**extra, **out}


def write_eagle3(src, out: Path, dtype: torch.dtype | None) -> list[Path]:
    dt = dtype or src.stored_dtype
    save_tensors(src.tensors(dt), out)
    write_json(eagle3_config(src, dt), out / "config.json")
    return [out / "config.json", out / "model.safetensors"]
