"""Greedy draft chains from the true context at many positions of one sequence, with what each step
attends to, the magnitude of the state it feeds back, and whether its token matches the target.

Pairing as in the engine (speculation/proposer.py): context pair t = (target aux state at t, token t+1) at
position t. A chain rooted at token index r (the target's latest token) starts from the last context
pair r-1; step d >= 2 feeds (state of step d-1, token drafted at d-1) at position r-2+d and attends to
the context pairs 0..r-1 plus the chain's own steps 2..d. So the "own" keys at depth d are d-1 drafted
tokens (none at depth 1, whose query is the context pair r-1 itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafter import Eagle3Drafter
from .forward import context_kv, drafter_step


@dataclass
class ChainRecord:
    """Per chain (rows) and depth (columns, depth 1..D)."""

    sink: torch.Tensor  # attention mass on the first S context pairs (mean over heads)
    context: torch.Tensor  # on the other context pairs
    own: torch.Tensor  # on the chain's own drafted tokens
    own_uniform: torch.Tensor  # the own-token share uniform attention would give: (d-1) / (r+d-1)
    fed_back_rms: torch.Tensor  # RMS of the state passed to the next step
    prenorm_rms: torch.Tensor  # RMS of the layer output before the final norm
    drafted: torch.Tensor  # drafted target ids
    expected: torch.Tensor  # the target's greedy continuation

    @classmethod
    def concat(cls, records: list[ChainRecord]) -> ChainRecord:
        return cls(*(torch.cat([getattr(r, f) for r in records]) for f in cls.__dataclass_fields__))

    @property
    def accepted_length(self) -> torch.Tensor:
        """[C] leading drafted tokens equal to the target's continuation."""
        return (self.drafted == self.expected).long().cumprod(-1).sum(-1)


def rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1).sqrt()


SINK, CONTEXT, OWN = 0, 1, 2  # what a key column is, for splitting the attention mass


@torch.inference_mode()
def draft_chains(drafter: Eagle3Drafter, seq: torch.Tensor, aux: torch.Tensor, roots: list[int], depth: int,
                 sink_tokens: int) -> ChainRecord:  # fmt: skip
    """Chains of `depth` greedy drafts rooted at each index in `roots` of `seq` ([L] token ids, with
    `aux` [L, A*Ht] the target's captured states); needs 1 <= r and r + depth < L for every root."""
    if not roots or min(roots) < 1 or max(roots) + depth >= seq.numel():
        raise ValueError(f"chain roots must lie in [1, {seq.numel() - depth}) for depth {depth}, got {roots}")
    n_ctx = max(roots)
    ctx_pos = torch.arange(n_ctx, device=seq.device)
    hidden = drafter.project(aux[None, :n_ctx])
    ctx_k, ctx_v = context_kv(drafter, seq[None, 1 : n_ctx + 1], hidden, ctx_pos[None])
    root = torch.tensor(roots, device=seq.device)
    chains = root.numel()
    ctx_k, ctx_v = ctx_k.expand(chains, -1, -1, -1), ctx_v.expand(chains, -1, -1, -1)
    own_k, own_v = ctx_k[:, :, :0], ctx_v[:, :, :0]
    ctx_kind = torch.where(ctx_pos < sink_tokens, SINK, CONTEXT).expand(chains, -1)
    # depth 1: the query is the last context pair r-1 itself; it sees the pairs before it, and its own key
    ids, state, pos = seq[root][:, None], hidden[0, root - 1][:, None], (root - 1)[:, None]
    ctx_seen = ctx_pos[None] < pos
    new_kind = torch.where(pos < sink_tokens, SINK, CONTEXT)
    columns = {name: [] for name in ChainRecord.__dataclass_fields__}
    for d in range(1, depth + 1):
        visible = torch.cat([ctx_seen, torch.ones_like(new_kind, dtype=torch.bool)], 1)[:, None, None]
        trace = drafter_step(drafter, ids, state, pos, torch.cat([ctx_k, own_k], 2), torch.cat([ctx_v, own_v], 2),
                             visible)  # fmt: skip
        probs = trace.probs[:, :, 0].mean(1)  # [C, key columns], mean over heads
        mass = probs.new_zeros(chains, 3).scatter_add_(1, torch.cat([ctx_kind, new_kind], 1), probs)
        token = drafter.draft_to_target[trace.logits[:, 0].argmax(-1)]
        step = {
            "sink": mass[:, SINK], "context": mass[:, CONTEXT], "own": mass[:, OWN],
            "own_uniform": (d - 1) / (root + d - 1.0), "fed_back_rms": rms(trace.state[:, 0]),
            "prenorm_rms": rms(trace.prenorm[:, 0]), "drafted": token, "expected": seq[root + d],
        }  # fmt: skip
        for name, value in step.items():
            columns[name].append(value)
        # next depth: this draft and state one position on, seeing the whole context and the drafts so far
        if d > 1:
            own_k, own_v = torch.cat([own_k, trace.keys], 2), torch.cat([own_v, trace.values], 2)
        ids, state, pos = token[:, None], trace.state, pos + 1
        ctx_seen = ctx_pos[None] < root[:, None]
        new_kind = torch.full((chains, own_k.shape[2] + 1), OWN, device=seq.device)
    return ChainRecord(**{name: torch.stack(values, 1).cpu() for name, values in columns.items()})
