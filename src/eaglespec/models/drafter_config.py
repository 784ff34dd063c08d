"""The EAGLE-3 drafter's config.json: DrafterConfig, read from either dialect and written as dialect A.

Dialect A (`LlamaForCausalLMEagle3`): a flat Llama config with the drafter's keys, as vLLM, SGLang and
EAGLE read and write it. Dialect B (vLLM's speculators): the layer's Llama config nested under
`transformer_layer_config`, the EAGLE-3 keys beside it. Keys this code does not know are kept and
written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .io import CheckpointError


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # target vocabulary V (embedding rows)
    draft_vocab_size: int  # Vd (lm_head rows)
    target_hidden_size: int | None = None  # Ht when it differs from hidden_size
    head_dim: int | None = None
    num_aux_hidden_states: int = 3
    aux_layer_ids: list[int] | None = None  # vLLM convention: capture *before* these layers
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048  # informational: RoPE works at every position
    # sliding window of the drafter's own attention (None: none): a query at position p sees keys at
    # positions > p - window, in training and at inference, so its cost stays flat as the context grows
    draft_attention_window: int | None = None
    hidden_act: str = "silu"
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    fc_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_hidden_layers: int = 1
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)  # unknown keys, kept on save

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def target_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def eagle_version(self) -> str:
        if self.fc_norm and self.norm_output:
            return "EAGLE-3.1"
        # one switch alone is an ablation, neither EAGLE-3.1 nor EAGLE-3
        return "EAGLE-3 + fc_norm" if self.fc_norm else "EAGLE-3 + norm_output" if self.norm_output else "EAGLE-3"

    @classmethod
    def from_dict(cls, raw: dict) -> DrafterConfig:
        raw = dict(raw)
        if "transformer_layer_config" in raw:  # speculators dialect B: flatten the nested layer config
            layer = raw.pop("transformer_layer_config")
            raw = {**layer, **raw}
            raw.setdefault("norm_before_residual", True)  # speculators' default when the key is missing
        eagle_cfg = raw.get("eagle_config") or {}
        layers = int(raw.get("num_hidden_layers", 1))
        if layers != 1:
            raise CheckpointError(f"drafter has num_hidden_layers={layers}; eaglespec supports 1-layer drafters")
        if eagle_cfg.get("use_aux_hidden_state", True) is False:
            raise CheckpointError("drafter config sets eagle_config.use_aux_hidden_state: false (an EAGLE-1/2 style "
                                  "drafter without fc); eaglespec runs EAGLE-3 drafters, which read target states")
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":  # transformers 5 keeps it here
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        need = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise CheckpointError(f"drafter config.json lacks required keys {missing}")
        known = set(cls.__dataclass_fields__)
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size"),
            head_dim=raw.get("head_dim"),
            num_aux_hidden_states=int(raw.get("num_aux_hidden_states") or (len(ids) if ids else 3)),
            aux_layer_ids=list(ids) if ids else None,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            draft_attention_window=_window(raw.get("draft_attention_window")),
            hidden_act=raw.get("hidden_act", "silu"),
            fc_norm=bool(raw.get("fc_norm", raw.get("use_aux_norm", False))),
            norm_output=bool(raw.get("norm_output", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", eagle_cfg.get("norm_before_fc", False))),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            fc_bias=bool(raw.get("bias", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
            extra={k: v for k, v in raw.items() if k not in known and k not in _WRITTEN_KEYS},
        )

    def to_dict(self) -> dict:
        """Config dialect A: a flat Llama config read by vLLM, SGLang and EAGLE."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_size,
            "num_hidden_layers": 1,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": self.torch_dtype,
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids:  # only custom ids; defaults are omitted (engines agree on them)
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if self.num_aux_hidden_states != 3:
            d["num_aux_hidden_states"] = self.num_aux_hidden_states
        for flag in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
            if getattr(self, flag):
                d[flag] = True
        if self.fc_bias:
            d["bias"] = True
        if self.draft_attention_window:
            d["draft_attention_window"] = self.draft_attention_window
        return {**self.extra, **d}

    def hf_rope_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_size,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )


def _window(value) -> int | None:
    """draft_attention_window from a config: a positive integer, or null/0 for none."""
    if value in (None, 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"draft_attention_window must be a positive integer or null, got {value!r}")
    return value


_WRITTEN_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "torch_dtype", "dtype",
    "eagle_aux_hidden_state_layer_ids", "eagle_config", "use_aux_norm", "bias", "rope_parameters",
    "speculators_model_type", "speculators_config", "speculators_version", "transformers_version",
    "embed_requires_grad", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "pretraining_tp", "use_cache", "attention_dropout",
}  # fmt: skip


def new_drafter_config(target_cfg, *, draft_vocab_size: int | None = None, fc_norm=True, norm_output=True,
                       intermediate_size=None, num_heads=None, num_kv_heads=None, aux_layer_ids=None,
                       max_position_embeddings=None, draft_attention_window=None) -> DrafterConfig:  # fmt: skip
    """A drafter config sized for `target_cfg` (a TargetConfig); EAGLE-3.1 by default."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=num_heads or target_cfg.num_heads,
        num_key_value_heads=num_kv_heads or target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size or target_cfg.vocab_size,
        rms_norm_eps=target_cfg.rms_norm_eps,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else None,
        max_position_embeddings=max_position_embeddings or target_cfg.max_position_embeddings,
        draft_attention_window=_window(draft_attention_window),
        fc_norm=fc_norm,
        norm_output=norm_output,
        torch_dtype="bfloat16",
    )
