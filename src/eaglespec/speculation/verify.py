"""Acceptance: which path of a draft tree the target keeps, plus its own next token.

Greedy: a node is accepted when every node on its path equals the target's argmax after its parent.
Sampling uses the same rule on scores (sampling.token_scores): log p plus Gumbel noise shared by all
nodes at one position, so the argmax at each node is an exact sample of the target there, and a draft
token is accepted with probability p(x), as with rejection sampling of point-mass drafts (Leviathan et al., 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


@dataclass
class Acceptance:
    """path [B, D+1] node indices root..last accepted (padded by repeating the last);
    accepted [B] number of accepted draft tokens; next_token [B] the target's own token."""

    path: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor


def _path_to(tree: DraftTree, best: torch.Tensor, max_depth: int) -> torch.Tensor:
    b, n = tree.tokens.shape
    on_path = tree.mask.gather(1, best[:, None, None].expand(b, 1, n))[:, 0]  # [B, n]
    slot = torch.where(on_path, tree.depth, torch.full_like(tree.depth, max_depth + 1))
    path = torch.zeros(b, max_depth + 2, dtype=torch.long, device=best.device)
    path.scatter_(1, slot, torch.arange(n, device=best.device).expand(b, n))
    path = path[:, : max_depth + 1]
    # pad past the last accepted node with the last node (harmless for compaction/gathers)
    steps = torch.arange(max_depth + 1, device=best.device)
    last = tree.depth.gather(1, best[:, None])
    return torch.where(steps[None] <= last, path, best[:, None])


def accept_greedy(tree: DraftTree, logits: torch.Tensor, max_depth: int) -> Acceptance:
    """logits [B, N+1, V] of the target at every tree node."""
    top = logits.argmax(-1)  # [B, N+1]
    if top.shape[1] == 1:  # a plain step (the root alone): nothing to accept; skips ~0.3 ms of tree ops
        path = torch.zeros(top.shape[0], max_depth + 1, dtype=torch.long, device=top.device)
        return Acceptance(path, path[:, 0], top[:, 0])
    expected = top.gather(1, tree.parent.clamp(min=0))
    bad = (tree.tokens != expected) & (tree.parent >= 0)
    ok = (tree.mask.to(torch.int32) @ bad.to(torch.int32)[:, :, None])[:, :, 0] == 0
    score = torch.where(ok, tree.depth, torch.full_like(tree.depth, -1))
    best = score.argmax(-1)  # first node of maximal accepted depth
    path = _path_to(tree, best, max_depth)
    return Acceptance(path, tree.depth.gather(1, best[:, None])[:, 0], top.gather(1, best[:, None])[:, 0])
