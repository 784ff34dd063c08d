"""Acceptance: which path of a draft tree the target keeps, plus its own next token.

Greedy: a node is accepted when every node on its path equals the target's argmax after its parent.
Sampling: multi-candidate recursive rejection sampling with point-mass drafts (reference §6.1):
at each accepted node try its children in order, accept child x with probability p(x) under the
residual distribution, zero p(x) and renormalise on rejection; the final token is drawn from the
residual at the node where the walk stopped (or the fresh distribution when nothing was rejected
there). This yields exact samples from the target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree, children_table


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
    expected = top.gather(1, tree.parent.clamp(min=0))
    bad = (tree.tokens != expected) & (tree.parent >= 0)
    ok = (tree.mask.to(torch.int32) @ bad.to(torch.int32)[:, :, None])[:, :, 0] == 0
    score = torch.where(ok, tree.depth, torch.full_like(tree.depth, -1))
    best = score.argmax(-1)  # first node of maximal accepted depth
    path = _path_to(tree, best, max_depth)
    return Acceptance(path, tree.depth.gather(1, best[:, None])[:, 0], top.gather(1, best[:, None])[:, 0])


def accept_sampling(
    tree: DraftTree, probs: torch.Tensor, max_depth: int, max_children: int, generator=None
) -> Acceptance:
    """probs [B, N+1, V]: processed target distribution at every node (sampling.target_probs)."""
    b, n, _ = probs.shape
    dev = probs.device
    rows = torch.arange(b, device=dev)
    children = children_table(tree.parent, max_children) if n > 1 else None
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    residual = probs[:, 0].clone()
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    for _ in range(max_depth if n > 1 else 0):
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        kids = children[rows, cur]  # [B, C]
        if not bool((alive & (kids[:, 0] >= 0)).any()):
            break
        for s in range(kids.shape[1]):
            child = kids[:, s]
            trying = alive & ~moved & (child >= 0)
            if not bool(trying.any()):
                continue
            tok = tree.tokens[rows, child.clamp(min=0)]
            p_tok = residual[rows, tok]
            u = torch.rand(b, generator=generator, device=dev, dtype=torch.float32)
            take = trying & (u < p_tok)
            reject = trying & ~take
            residual[rows[reject], tok[reject]] = 0.0
            residual = torch.where(
                reject[:, None], residual / residual.sum(-1, keepdim=True).clamp_min(1e-30), residual
            )
            moved |= take
            cur = torch.where(take, child, cur)
        residual = torch.where(moved[:, None], probs[rows, cur], residual)
        alive &= moved
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return Acceptance(_path_to(tree, cur, max_depth), tree.depth[rows, cur], next_token)
