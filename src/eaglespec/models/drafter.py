"""The EAGLE-3 drafter layer with the EAGLE-3.1 switches.

One decoder layer fed with [norm(embedding of the next token), norm(hidden)] (width 2H). `hidden` is
either the fc-projection of A captured target states (first draft step at a position) or the drafter's
own recurrent state (deeper steps). EAGLE-3.1: `fc_norm` RMS-normalises each captured target state
before fc; `norm_output` feeds the post-norm state back. With both off this is exactly EAGLE-3.
Its config: models/drafter_config.py; reading and writing drafter directories: models/checkpoint.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import KVCache, StepMeta
from .drafter_config import DrafterConfig
from .io import CheckpointError
from .layers import MLP, Attention, RMSNorm, Rotary, rope_tables


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
        """Use these Vd target ids as the draft vocabulary (sorted ascending; d2t holds offsets: draft id i
        is target id i + d2t[i])."""
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
        p = self.norm.weight  # not a linear's: those may be quantized
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

    def forward(self, ids, hidden, positions, cache: KVCache, meta: StepMeta, *, at: torch.Tensor | None = None):
        """(draft logits [B, T, Vd], next state [B, T, H]); with `at` [B] only those at token at[b] of each
        row ([B, Vd], [B, H]): a prompt's extend needs one position per row, so lm_head runs on that alone."""
        attend = lambda u, cos, sin: self.midlayer.self_attn(u, cos, sin, cache, 0, meta)
        if at is None:
            return self.step(ids, hidden, positions, attend)
        normed, state = self.step(ids, hidden, positions, attend, with_logits=False)
        pick = at.to(normed.device)[:, None, None]
        normed = normed.gather(1, pick.expand(-1, 1, normed.shape[-1]))[:, 0]
        return self.lm_head(normed), state.gather(1, pick.expand(-1, 1, state.shape[-1]))[:, 0]

    def step(self, ids, hidden, positions, attend, *, with_logits: bool = True):
        """The layer math with attention supplied by the caller: attend(u, cos, sin) -> [B, T, H].
        Inference attends through the KV cache; training-time test through its own TTT mask.
        Returns (draft logits, or the final-normed hidden when with_logits=False, and the next state)."""
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
