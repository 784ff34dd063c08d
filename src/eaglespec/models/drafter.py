"""The EAGLE-3 drafter layer with the EAGLE-3.1 switches, and its portable checkpoint format.

One decoder layer fed with [norm(embedding of the next token), norm(hidden)] (width 2H). `hidden` is
either the fc-projection of A captured target states (first draft step at a position) or the drafter's
own recurrent state (deeper steps). EAGLE-3.1: `fc_norm` RMS-normalises each captured target state
before fc; `norm_output` feeds the post-norm state back. With both off this is exactly EAGLE-3.
On disk (reference §1): bare keys, `midlayer.*`, config dialect A (`LlamaForCausalLMEagle3`), so drafters
published for vLLM/SGLang load here and ours load there. The speculators dialect B is read too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..kv_cache import KVCache, StepMeta
from .io import CheckpointError, load_tensors, parse_dtype, read_config, save_tensors, write_json
from .layers import MLP, Attention, RMSNorm, Rotary, rope_tables


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
        """Config dialect A (reference §1.1): a flat Llama config read by vLLM, SGLang and EAGLE."""
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


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the fused / recurrent hidden
        self.self_attn = Attention(
            2 * h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size, bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
        )  # fmt: skip
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)


class Eagle3Drafter(nn.Module):
    """forward(ids, hidden, positions, cache, meta) -> (draft logits [B,T,Vd], next state [B,T,H]).

    ids are *target* token ids (the token after each hidden state's position); hidden is [B,T,H], the
    output of `project` for target features or a previous forward's state.
    """

    def __init__(self, cfg: DrafterConfig, own_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        h, ht, a = cfg.hidden_size, cfg.target_width, cfg.num_aux_hidden_states
        if cfg.fc_norm and cfg.norm_before_fc:
            raise CheckpointError("drafter config sets both fc_norm and norm_before_fc; they are exclusive")
        self.fc = nn.Linear(a * ht, h, bias=cfg.fc_bias)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(ht, cfg.rms_norm_eps) for _ in range(a))
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(a * ht, cfg.rms_norm_eps)
        self.midlayer = DrafterLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
        self.rotary = Rotary(*rope_tables(cfg.hf_rope_config()))
        self._target_embed: nn.Embedding | None = None

    # -- wiring ----------------------------------------------------------------------------------
    def attach_target_embedding(self, embed: nn.Embedding) -> None:
        """Share the target's (frozen) embedding when the checkpoint ships none of its own."""
        self._target_embed = embed

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these Vd target ids as the draft vocabulary (reference §3: sorted ascending, offsets)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.cfg.draft_vocab_size} distinct target ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._target_embed
        if table is None:
            raise RuntimeError("drafter has no embedding: call attach_target_embedding(target embedding)")
        return table(ids)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target token id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def new_cache(self, num_slots: int, max_length: int, initial_capacity: int = 256) -> KVCache:
        p = self.fc.weight
        return KVCache(1, num_slots, self.cfg.num_key_value_heads, self.cfg.head_size, max_length=max_length,
                       dtype=p.dtype, device=p.device, initial_capacity=initial_capacity,
                       sliding_window=self.cfg.draft_attention_window)  # fmt: skip

    # -- math ------------------------------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., A*Ht] captured target states -> [.., H] fused hidden (fc with the 3.1 input norms)."""
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        elif self.cfg.fc_norm:
            chunks = aux.chunk(self.cfg.num_aux_hidden_states, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(self, ids, hidden, positions, cache: KVCache, meta: StepMeta, *, with_logits: bool = True):
        attend = lambda u, cos, sin: self.midlayer.self_attn(u, cos, sin, cache, 0, meta)
        return self.step(ids, hidden, positions, attend, with_logits=with_logits)

    def step(self, ids, hidden, positions, attend, *, with_logits: bool = True):
        """The layer math with attention supplied by the caller: attend(u, cos, sin) -> [B, T, H].
        Inference attends through the KV cache; training-time test through its own TTT mask.
        Returns (draft logits, or the final-normed hidden when with_logits=False, and the next state):
        a prompt's extend only needs logits at one position per row, so it applies lm_head itself."""
        layer = self.midlayer
        e = self.embed(ids).to(hidden.dtype)
        hn = layer.hidden_norm(hidden)
        residual = hn if self.cfg.norm_before_residual else hidden
        u = torch.cat([layer.input_layernorm(e), hn], dim=-1)
        cos, sin = self.rotary(positions, hidden.dtype)
        x = residual + attend(u, cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        n = self.norm(x)
        state = n if self.cfg.norm_output else x  # EAGLE-3.1 feeds the post-norm state back
        return (self.lm_head(n) if with_logits else n), state


# -- portable checkpoints ------------------------------------------------------------------------
def drafter_state_dict(model: Eagle3Drafter, include_embedding: bool = False) -> dict[str, torch.Tensor]:
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("_target_embed")}
    if not include_embedding:
        sd.pop("embed_tokens.weight", None)
    sd["d2t"] = model.d2t.to(torch.long)
    sd["t2d"] = model.t2d.to(torch.bool)
    return sd


def save_drafter(model: Eagle3Drafter, path, *, dtype: str | torch.dtype = "bf16", include_embedding=False,
                 extra_config: dict | None = None) -> None:  # fmt: skip
    """Write config.json (dialect A) + model.safetensors with bare keys (`midlayer.*`, `fc.weight`, ...)."""
    dt = parse_dtype(dtype)
    tensors = {
        k: (v.to(dt) if v.is_floating_point() else v) for k, v in drafter_state_dict(model, include_embedding).items()
    }
    cfg = model.cfg.to_dict()
    cfg["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dt, "float32")
    cfg.update(extra_config or {})
    save_tensors(tensors, path)
    write_json(cfg, Path(path) / "config.json")


def load_drafter(path, *, target=None, device="cpu", dtype="fp32") -> Eagle3Drafter:
    """Load and validate a drafter directory. With `target` (a LlamaTarget), check that they fit."""
    raw = read_config(path)
    cfg = DrafterConfig.from_dict(raw)
    tensors = load_tensors(path)
    if "midlayer.input_layernorm.weight" not in tensors and "layers.0.input_layernorm.weight" in tensors:
        tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items()}
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}  # NeMo/SGLang-style prefix
    if "fc_norm.0.weight" in tensors and not cfg.fc_norm:
        raise CheckpointError(f"{path}: has fc_norm.* tensors but config.json does not set fc_norm: true")
    model = Eagle3Drafter(cfg, own_embedding="embed_tokens.weight" in tensors)
    if "d2t" not in tensors and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size but no d2t tensor")
    tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    if "t2d" not in tensors:  # derive from d2t (engines ignore t2d at inference)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    from .checkpoint import _assign

    _assign(model, tensors, str(path), ignore=("mask_hidden",))
    model.d2t = model.d2t.long()
    model.t2d = model.t2d.bool()
    _check_vocab_mapping(model, str(path))
    model.to(device=device, dtype=parse_dtype(dtype))
    model.d2t, model.t2d = model.d2t.long(), model.t2d.bool()
    if target is not None:
        check_pair(model, target, str(path))
    return model.eval().requires_grad_(False)


def _check_vocab_mapping(model: Eagle3Drafter, where: str) -> None:
    ids = model.draft_to_target
    if ids.numel() and (ids.min() < 0 or ids.max() >= model.cfg.vocab_size):
        raise CheckpointError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {model.cfg.vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError(f"{where}: d2t maps several draft ids to the same target id")
    if int(model.t2d.sum()) != model.cfg.draft_vocab_size:
        raise CheckpointError(f"{where}: t2d has {int(model.t2d.sum())} entries set, expected draft_vocab_size")


def check_pair(drafter: Eagle3Drafter, target, where: str = "drafter") -> None:
    """Raise CheckpointError unless the drafter fits the target (widths, vocabulary, aux layers)."""
    c, t = drafter.cfg, target.cfg
    problems = []
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
    if c.target_width != t.hidden_size:
        problems.append(
            f"drafter expects target hidden size {c.target_width} but the target has {t.hidden_size} "
            "(set target_hidden_size, or train a drafter for this target)"
        )
    if drafter.embed_tokens is None and c.hidden_size != t.hidden_size:
        problems.append("drafter hidden_size differs from the target's and it ships no embed_tokens.weight")
    n_aux = len(c.aux_layer_ids) if c.aux_layer_ids else 3
    if c.num_aux_hidden_states != n_aux:
        problems.append(f"num_aux_hidden_states {c.num_aux_hidden_states} != number of aux layer ids {n_aux}")
    if c.aux_layer_ids and any(not 0 <= i < t.num_layers for i in c.aux_layer_ids):
        problems.append(f"aux layer ids {c.aux_layer_ids} outside the target's {t.num_layers} layers")
    if problems:
        raise CheckpointError(f"{where} does not fit the target: " + "; ".join(problems))


def set_attention_window(drafter: Eagle3Drafter, window: int | None, target_context: int) -> None:
    """Override the drafter's attention window for inference: None keeps its config's, 0 removes it.
    Raises ValueError for a window that cannot apply; warns when the drafter runs outside what it was
    trained with (it would attend over distances it never saw)."""
    import warnings

    if window is None:
        return
    trained = drafter.cfg.draft_attention_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"the drafter's attention window must be an integer >= 0 (0: none), got {window!r}")
    if window > target_context:
        raise ValueError(f"drafter attention window {window} is larger than the target's context of {target_context} "
                         "tokens, so it would never apply; use a smaller window, or 0 for none")  # fmt: skip
    if trained and (window == 0 or window > trained):
        warnings.warn(f"the drafter was trained with draft_attention_window={trained} but runs with "
                      f"{'no window' if window == 0 else f'a window of {window}'}: it will attend over distances "
                      "it never saw in training, and acceptance may fall on long contexts", stacklevel=2)  # fmt: skip
    drafter.cfg.draft_attention_window = window or None


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
