"""Sampling parameters and the target-distribution processing shared by every decoding path.

Order as in `transformers`' default warpers: temperature, then top-k, then top-p. Greedy is
temperature 0. `target_probs` is the single definition of "the distribution we must preserve"; `token_scores`
turns it into per-row scores whose argmax is the sampled token (greedy and sampled rows in one batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _per_row(value, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] value as a tensor that broadcasts over like's [B, ..., V]."""
    t = torch.as_tensor(value, device=like.device)
    return t.view(*t.shape, *[1] * (like.dim() - t.dim()))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p."""
    return processed_probs(logits, params.temperature, params.top_p, params.top_k)


def processed_probs(logits: torch.Tensor, temperature, top_p, top_k) -> torch.Tensor:
    """target_probs with per-row settings: each of temperature (> 0), top_p and top_k is a scalar or a
    [B] tensor for logits [B, ..., V], so one batch can mix requests with different settings."""
    x = logits.float() / _per_row(temperature, logits).float()
    vocab = x.shape[-1]
    k = _per_row(top_k, logits).long()
    k_max = min(int(k.max()), vocab)
    if k_max > 0:
        top = x.topk(k_max, dim=-1).values
        kth = top.gather(-1, (k.clamp(1, k_max) - 1).expand(*x.shape[:-1], 1))
        x = x.masked_fill((k > 0) & (k < vocab) & (x < kth), float("-inf"))
    p = _per_row(top_p, logits).float()
    if bool((p < 1.0).any()):
        sorted_x, order = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = (cum <= 1 - p) & (p < 1.0)  # HF: remove the low tail whose mass is <= 1 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


@dataclass
class BatchSampling:
    """Per-row sampling settings of one step's batch, as tensors (built once per batch change)."""

    greedy: list[bool]
    seeds: list[int | None]  # per-request seeds: noise keyed by (seed, position), reproducible
    temperature: torch.Tensor  # [B], sampled rows only
    top_p: torch.Tensor
    top_k: torch.Tensor
    sampled: torch.Tensor  # [S] row indices of sampled rows

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int | None], device) -> BatchSampling:
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        pick = lambda f, dtype: torch.tensor([f(params[i]) for i in sampled], dtype=dtype, device=device)
        return cls([p.greedy for p in params], seeds, pick(lambda p: p.temperature, torch.float32),
                   pick(lambda p: p.top_p, torch.float32), pick(lambda p: p.top_k, torch.long),
                   torch.tensor(sampled, dtype=torch.long, device=device))  # fmt: skip

    @property
    def all_greedy(self) -> bool:
        return self.sampled.numel() == 0


def token_scores(logits: torch.Tensor, batch: BatchSampling, next_pos: torch.Tensor, generator=None) -> torch.Tensor:
    """[B, N, V] logits -> scores whose argmax is each row's token: the logits for greedy rows; for sampled
    rows log p + Gumbel noise (Gumbel-max: the argmax is an exact sample of p).

    next_pos [B, N]: the position of the token each node predicts. The noise depends on the row and that
    position only, so every tree node at one position shares it: verifying a tree by argmax then gives
    exactly the tokens plain decoding would sample, and a draft token is accepted with probability p(x)
    (as in rejection sampling with point-mass drafts). Rows with a seed draw their noise from a
    generator keyed by (seed, position): their output does not depend on the batch or on speculation.
    """
    if batch.all_greedy:
        return logits
    rows = batch.sampled
    probs = processed_probs(logits[rows], batch.temperature, batch.top_p, batch.top_k)
    pos = next_pos.to(logits.device)[rows]
    lo = pos.min(dim=1, keepdim=True).values
    span = int((pos - lo).max()) + 1
    noise = torch.empty(len(rows), span, logits.shape[-1], dtype=torch.float32, device=logits.device)
    unseeded = []
    for j, r in enumerate(rows.tolist()):
        seed = batch.seeds[r]
        if seed is None:
            unseeded.append(j)
            continue
        first = int(lo[j])
        for s in range(span):
            g = torch.Generator(device=logits.device).manual_seed(_position_seed(seed, first + s))
            noise[j, s] = torch.rand(logits.shape[-1], generator=g, device=logits.device)
    if unseeded:
        noise[unseeded] = torch.rand(len(unseeded), span, logits.shape[-1], generator=generator, device=logits.device)
    gumbel = -torch.log(-torch.log(noise.clamp_min(1e-30)))
    idx = (pos - lo)[:, :, None].expand(-1, -1, logits.shape[-1])
    sampled_scores = probs.log() + gumbel.gather(1, idx)
    if len(rows) == logits.shape[0]:
        return sampled_scores
    scores = logits.float().clone()
    scores[rows] = sampled_scores
    return scores


def _position_seed(seed: int, position: int) -> int:
    """One generator seed per (request seed, position), spread so nearby pairs do not collide."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
