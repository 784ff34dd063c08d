"""Draft trees as tensors: EAGLE-2 candidate reranking, ancestor masks, depths, sibling tables.

A tree of N+1 nodes per row: node 0 is the root (the last token the target produced, not yet in its
cache), nodes 1..N are draft tokens sorted so that parents precede children. A chain is the tree
with one child per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """tokens [B, N+1] target ids; parent [B, N+1] (root: -1); depth [B, N+1] (root: 0);
    mask [B, N+1, N+1] bool, mask[b, i, j] = j is i or an ancestor of i;
    score [B, N+1] the drafter's cumulative log-prob of each node (root 0; -inf for nodes that did
    not come from the drafter, e.g. copied from the context), or None."""

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    score: torch.Tensor | None = None

    @property
    def num_draft(self) -> int:
        return self.tokens.shape[1] - 1


@dataclass
class Candidates:
    """Everything the drafter proposed in one step, in generation order (level by level).

    tokens, scores, parent, depth: [B, M]; parent is a candidate index or -1 for the root.
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor


def root_only(root: torch.Tensor) -> DraftTree:
    """The trivial tree (plain decoding): root tokens [B]."""
    b = root.shape[0]
    zeros = torch.zeros(b, 1, dtype=torch.long, device=root.device)
    return DraftTree(root[:, None], zeros - 1, zeros, torch.ones(b, 1, 1, dtype=torch.bool, device=root.device))


def ancestor_mask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parent [B, n] (-1 = none) -> [B, n, n] bool self-or-ancestor mask."""
    b, n = parent.shape
    eye = torch.eye(n, dtype=torch.bool, device=parent.device).expand(b, n, n).clone()
    mask = eye.clone()
    cur = parent
    for _ in range(max_depth):
        valid = cur >= 0
        if not bool(valid.any()):
            break
        mask |= eye.gather(1, cur.clamp(min=0)[:, :, None].expand(b, n, n)) & valid[:, :, None]
        cur = torch.where(valid, parent.gather(1, cur.clamp(min=0)), cur)
    return mask


def build_tree(root: torch.Tensor, cand: Candidates, num_nodes: int, max_depth: int) -> DraftTree:
    """Keep the `num_nodes` best candidates (EAGLE-2 rerank) and return the verification tree.

    Scores are cumulative log-probs, so a child never outscores its parent; a tiny depth penalty breaks
    ties so the kept set is always ancestor-closed.
    """
    b, m = cand.tokens.shape
    if num_nodes < m:
        key = cand.scores - 1e-6 * cand.depth
        keep = key.topk(num_nodes, dim=-1).indices.sort(dim=-1).values  # generation order: parents first
    else:
        keep = torch.arange(m, device=root.device).expand(b, m)
    # candidate index -> node index (root is node 0)
    node_of = torch.full((b, m + 1), 0, dtype=torch.long, device=root.device)
    node_of.scatter_(1, keep + 1, torch.arange(1, keep.shape[1] + 1, device=root.device).expand_as(keep))
    cand_parent = cand.parent.gather(1, keep)
    parent = node_of.gather(1, cand_parent + 1)  # candidate -1 (root) -> slot 0 -> node 0
    minus1 = torch.full((b, 1), -1, dtype=torch.long, device=root.device)
    parent = torch.cat([minus1, parent], dim=1)
    tokens = torch.cat([root[:, None], cand.tokens.gather(1, keep)], dim=1)
    depth = torch.cat([torch.zeros_like(minus1), cand.depth.gather(1, keep)], dim=1)
    score = torch.cat([torch.zeros(b, 1, device=root.device), cand.scores.float().gather(1, keep)], dim=1)
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, max_depth), score)


def depth_table(scores: list[torch.Tensor], depths: list[int]) -> torch.Tensor:
    """[B, M] the depth of every candidate, level by level as in torch.cat(scores, 1)."""
    return torch.cat([torch.full(s.shape, d, dtype=torch.long, device=s.device) for s, d in zip(scores, depths)], 1)
