"""A drafter forward that returns its attention probabilities (SDPA does not).

`drafter_step` runs `Eagle3Drafter.step` — the drafter's own layer math — with an attention callback
that computes softmax(q·kᵀ/√hd + mask) explicitly over caller-supplied past keys plus the step's own
keys. Logits and fed-back states are therefore the drafter's own; the hook on the final norm adds the
pre-norm layer output, which EAGLE-3.1 does not pass on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.drafter import Eagle3Drafter


@dataclass
class StepTrace:
    logits: torch.Tensor  # [B, T, Vd]
    state: torch.Tensor  # [B, T, H] what the recurrence feeds to the next step
    prenorm: torch.Tensor  # [B, T, H] layer output before the final norm
    probs: torch.Tensor  # [B, heads, T, P + T] attention probabilities over past keys, then this step's keys
    keys: torch.Tensor  # [B, kv_heads, T, hd] this step's keys (RoPE applied)
    values: torch.Tensor  # [B, kv_heads, T, hd]


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, kv_heads, S, hd] -> [B, heads, S, hd]: query head h reads kv head h // (heads / kv_heads)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def attention_probs(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√hd) over visible keys, in fp32. q [B, heads, T, hd], k [B, kv_heads, S, hd],
    visible [B, 1, T, S] bool."""
    scores = q.float() @ repeat_kv(k, q.shape[1]).float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def drafter_step(drafter: Eagle3Drafter, ids, hidden, positions, past_k, past_v, visible) -> StepTrace:
    """One drafter forward over T new pairs (ids [B, T] target ids, hidden [B, T, H], positions [B, T])
    attending to past_k/past_v ([B, kv_heads, P, hd]) and to themselves; visible [B, 1, T, P + T]."""
    attn = drafter.midlayer.self_attn
    seen: dict[str, torch.Tensor] = {}

    def attend(u, cos, sin):
        q, k, v = attn.qkv(u, cos, sin)
        probs = attention_probs(q, torch.cat([past_k, k], dim=2), visible)
        values = repeat_kv(torch.cat([past_v, v], dim=2), q.shape[1])
        seen.update(probs=probs, keys=k, values=v)
        return attn.out(probs.to(values.dtype) @ values)

    hook = drafter.norm.register_forward_hook(lambda _module, inputs, _out: seen.update(prenorm=inputs[0]))
    try:
        logits, state = drafter.step(ids, hidden, positions, attend)
    finally:
        hook.remove()
    return StepTrace(logits, state, seen["prenorm"], seen["probs"], seen["keys"], seen["values"])


def context_kv(drafter: Eagle3Drafter, ids, hidden, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of context pairs ([B, kv_heads, T, hd]). In a one-layer drafter they depend on
    each pair alone, so no attention is computed (the rest of the layer runs on a zero attention output)."""
    attn = drafter.midlayer.self_attn
    kv: dict[str, torch.Tensor] = {}

    def keys_only(u, cos, sin):
        _, kv["k"], kv["v"] = attn.qkv(u, cos, sin)
        return u.new_zeros(*u.shape[:-1], drafter.cfg.hidden_size)

    drafter.step(ids, hidden, positions, keys_only)
    return kv["k"], kv["v"]
