"""vLLM's speculators layout (dialect B), as speculators 0.9 writes it (`Eagle3DraftModel`):
- config: `speculators_model_type: eagle3`, the decoder layer as a nested `transformer_layer_config`
  (a Llama config with an explicit head_dim: speculators builds its rotary table from a copy with the
  hidden size doubled, so without head_dim its RoPE would cover twice the head), `speculators_config`
  (algorithm, a greedy proposal with `speculative_tokens`, the verifier's name and architectures), and
  every flag written explicitly: vLLM's `update_eagle3` sets `norm_before_residual` to true when the key
  is missing, which silently changes the model;
- tensors: `layers.0.*` instead of `midlayer.*`, plus `embed_tokens.weight` copied from the target in the
  target's own dtype (speculators' own checkpoints ship it and its loader leaves it unset otherwise; an
  exact copy keeps the drafter's inputs what they are with the target's embedding).
Not representable, refused with the reason: a bias on fc (speculators' fc has none).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.io import CheckpointError, load_tensors, save_tensors, write_json
from .eagle3 import DTYPE_NAMES, rope_parameters

SPECULATORS_VERSION = "0.9.0"  # the version whose loader and forward our external check runs
EMBEDDING_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")


def layer_config(cfg) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope_parameters(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
    }


def speculators_config(src, dtype: torch.dtype, verifier: str, speculative_tokens: int) -> dict:
    cfg = src.cfg
    if speculative_tokens < 1:
        raise ValueError(f"speculative tokens must be >= 1, got {speculative_tokens}")
    out = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_width,
        "eagle_aux_hidden_state_layer_ids": src.aux_layer_ids,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": DTYPE_NAMES[dtype],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],  # fmt: skip
            "verifier": {"name_or_path": verifier, "architectures": list(src.target.raw.get("architectures") or [])},
        },
    }
    if cfg.draft_attention_window:  # ours; speculators and vLLM ignore it (the export says so)
        out["draft_attention_window"] = cfg.draft_attention_window
    return out


def target_embedding(target_dir: Path) -> torch.Tensor:
    found = load_tensors(target_dir, names=set(EMBEDDING_KEYS))
    for key in EMBEDDING_KEYS:
        if key in found:
            return found[key]
    raise CheckpointError(f"{target_dir}: no token embedding ({' / '.join(EMBEDDING_KEYS)}) in the target's weights")


def speculators_tensors(src, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in src.tensors(dtype).items()}  # fmt: skip
    if "embed_tokens.weight" not in tensors:
        embed = target_embedding(src.target.path)
        if tuple(embed.shape) != (src.cfg.vocab_size, src.cfg.hidden_size):
            raise CheckpointError(f"{src.target.path}: embedding {tuple(embed.shape)} does not fit the drafter "
                                  f"({src.cfg.vocab_size}, {src.cfg.hidden_size})")  # fmt: skip
        tensors["embed_tokens.weight"] = embed.contiguous()  # the target's own values and dtype: an exact copy
    return tensors


def write_speculators(src, out: Path, dtype: torch.dtype | None, *, verifier: str | None,
                      speculative_tokens: int) -> list[Path]:  # fmt: skip
    dt = dtype or src.stored_dtype
    name = verifier or str(src.target.path.resolve())
    config = speculators_config(src, dt, name, speculative_tokens)
    save_tensors(speculators_tensors(src, dt), out)
    write_json(config, out / "config.json")
    return [out / "config.json", out / "model.safetensors"]
