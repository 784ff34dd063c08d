"""Training-time test: the drafter unrolled on its own hidden states for `depth` steps.

Row t of step 0 pairs the target's captured states at position t with the token x[t+1] and predicts
x[t+2]. Step k feeds back the drafter's own state from step k-1 with the teacher-forced token
x[t+1+k], at RoPE position t+k, and predicts x[t+2+k]. Attention at step k: the step-0 keys at
indices <= t (causal) plus, for each step j = 1..k, the key of step j at the same index t only
(the chain's own earlier tokens). One softmax over T + k columns.

Loss (soft cross-entropy against the target restricted to the draft vocabulary, renormalised):
    loss_k(sample) = -1/T * sum_t mask_k[t] * sum_v p_k[t, v] * log q_k[t, v]
    loss = mean over samples of sum_k decay**k * loss_k
mask_k[t] = (token x[t+2+k] is an assistant token) and (target argmax at t+1+k is in the draft vocab).
Dividing by each sample's own length T is the reference code's mean over rows at micro-batch size 1, so
the loss does not depend on how samples are batched or padded (and DDP equals one process).
Decision (a quirk of the reference code): it masks step k with loss_mask[t+k], two positions before
the predicted token; we mask with the predicted token's own flag, which is what the mask means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv_cache import KVCache, causal_mask
from ..models.drafter import Eagle3Drafter
from ..models.llama import LlamaTarget


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B]


@dataclass
class Targets:
    """Per position t: the target's distribution over the draft vocabulary for the token after t."""

    probs: torch.Tensor  # [B, T, Vd] renormalised over the draft vocabulary
    in_vocab: torch.Tensor  # [B, T] bool: target argmax is a draft-vocabulary token


def collate(samples, max_len: int | None = None) -> Batch:
    lengths = torch.tensor([min(len(s.input_ids), max_len or len(s.input_ids)) for s in samples])
    t = int(lengths.max())
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    mask = torch.zeros(len(samples), t, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = int(lengths[i])
        ids[i, :n], mask[i, :n] = s.input_ids[:n], s.loss_mask[:n]
    return Batch(ids, mask, lengths)


TARGET_CHUNK = 2048  # positions per target forward: the mask and scores of one chunk bound peak memory


@torch.no_grad()
def target_features(target: LlamaTarget, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal pass of the target over the batch, in chunks: (aux [B, T, A*H], logits [B, T, V])."""
    aux, h = _target_pass(target, batch)
    return aux, target.logits(h)


def _target_pass(target: LlamaTarget, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = batch.input_ids.shape
    device = next(target.parameters()).device
    cache: KVCache = target.new_cache(b, max_length=t, initial_capacity=t)  # a fresh cache: slots 0..B-1
    ids, lengths = batch.input_ids.to(device), batch.lengths.to(device)
    aux, hidden = [], []
    for c0 in range(0, t, TARGET_CHUNK):
        n = min(TARGET_CHUNK, t - c0)
        meta = cache.prepare(None, causal_mask((lengths - c0).clamp(0, n), n))
        h, a = target(ids[:, c0 : c0 + n], meta.write_pos, cache, meta)
        cache.commit(None, torch.full((b,), n))  # padding columns are never visible to real tokens
        aux.append(a)
        hidden.append(h)
    return torch.cat(aux, 1), torch.cat(hidden, 1)


@torch.no_grad()
def cropped_features(target: LlamaTarget, batch: Batch, last: int) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """Target features over each whole sample, and the drafter's view of it: its last `last` tokens.

    The drafter then trains on what it sees at inference after a long prompt (the last prompt pairs and
    the reply, at its own positions from 0) while the captured states carry the whole context. Returns
    (the cropped batch, aux [B, last, A*H], logits [B, last, V]); logits are computed on the crop only."""
    aux, h = _target_pass(target, batch)
    width = min(last, batch.input_ids.shape[1])
    start = (batch.lengths - width).clamp(min=0)
    idx = start[:, None] + torch.arange(width)
    lengths = batch.lengths.clamp(max=width)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    idx = torch.where(valid, idx, 0)
    pick = lambda x: x.gather(1, idx.to(x.device)[:, :, None].expand(-1, -1, x.shape[-1]))
    cropped = Batch(batch.input_ids.gather(1, idx) * valid, batch.loss_mask.gather(1, idx) & valid, lengths)
    return cropped, pick(aux), target.logits(pick(h))


def targets_from_logits(logits: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor) -> Targets:
    logits = logits.float()
    return Targets(logits.index_select(-1, draft_ids).softmax(-1), t2d[logits.argmax(-1)])


def targets_from_topk(top_p: torch.Tensor, top_i: torch.Tensor, target_to_draft: torch.Tensor) -> Targets:
    """From cached top-k target probabilities (offline training). target_to_draft maps a target id to its
    draft id or -1. Mass outside the top k is unknown and treated as 0 (an approximation: see states.py)."""
    vd = int(target_to_draft.max()) + 1
    d = target_to_draft[top_i.long()]  # [B, T, K]
    keep = d >= 0
    probs = torch.zeros(*top_p.shape[:-1], vd, dtype=torch.float32, device=top_p.device)
    probs.scatter_add_(-1, d.clamp(min=0), top_p.float() * keep)
    total = probs.sum(-1, keepdim=True)
    probs = probs / total.clamp(min=1e-12)
    return Targets(probs, keep[..., 0])  # top_i[..., 0] is the argmax


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, zero-filled at the end."""
    if n == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-n] = x[:, n:]
    return out


def ttt_attention(attn, u, cos, sin, keys: list, values: list, causal: torch.Tensor) -> torch.Tensor:
    """Attention of step k = len(keys) (before append) with the TTT mask; appends this step's k/v."""
    q, k, v = attn.qkv(u, cos, sin)
    rep = attn.num_heads // attn.num_kv_heads
    keys.append(k.repeat_interleave(rep, 1))
    values.append(v.repeat_interleave(rep, 1))
    scale = attn.head_dim**-0.5
    block = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
    block = block.masked_fill(~causal, float("-inf"))
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # [B, h, T, 1] each
    probs = torch.cat([block, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    t = block.shape[-1]
    out = probs[..., :t] @ values[0]
    for j, vj in enumerate(values[1:]):
        out = out + probs[..., t + j : t + j + 1] * vj
    return attn.out(out)


def ttt_forward(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Draft logits [B, T, Vd] of each TTT step (teacher-forced tokens, own hidden states fed back)."""
    b, t = input_ids.shape
    hidden = drafter.project(aux)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
    keys, values = [], []
    window = drafter.cfg.draft_attention_window
    # step k queries sit at position t + k: with a window they see step-0 keys at positions > t + k - window
    visible = lambda k: causal if window is None else causal & ~causal.tril(-(window - k))
    attend = lambda u, cos, sin: ttt_attention(drafter.midlayer.self_attn, u, cos, sin, keys, values,
                                               visible(len(keys)))
    logits = []
    for k in range(depth):
        step_logits, hidden = drafter.step(shift(input_ids, 1 + k), hidden, positions + k, attend)
        logits.append(step_logits)
    return logits


def step_masks(batch: Batch, targets: Targets, depth: int) -> list[torch.Tensor]:
    """mask_k[t]: x[t+2+k] is an assistant token and the target argmax at t+1+k is in the draft vocab."""
    return [shift(batch.loss_mask, 2 + k) & shift(targets.in_vocab, 1 + k) for k in range(depth)]


def ttt_loss(logits: list[torch.Tensor], batch: Batch, targets: Targets, decay: float = 0.8):
    """(loss per sample [B] with grad, per-step stats {loss_k [B], correct_k, count_k})."""
    lengths = batch.lengths.to(logits[0].device).float()
    masks = step_masks(batch, targets, len(logits))
    total = torch.zeros_like(lengths)
    stats = []
    for k, (lg, mask) in enumerate(zip(logits, masks)):
        p = shift(targets.probs, 1 + k)
        logq = F.log_softmax(lg.float(), dim=-1)
        per_row = -(p * logq).sum(-1) * mask  # [B, T]
        loss_k = per_row.sum(1) / lengths
        total = total + decay**k * loss_k
        with torch.no_grad():
            correct = ((lg.argmax(-1) == p.argmax(-1)) & mask).sum()
        stats.append({"loss": loss_k.detach(), "correct": int(correct), "count": int(mask.sum())})
    return total, stats
