"""Synthetic acceptance for cost benchmarks: accept by a given per-position profile, not by the target.

A profile is vLLM's per-position acceptance: profile[i] = share of drafts with at least i+1 accepted
tokens (non-increasing, in [0, 1]). Each row draws its accepted depth a with P(a >= i) = profile[i-1]
(0 past the profile's end), capped by the deepest node of its tree. The output is NOT the target's:
this exists to measure what a step costs at a known acceptance, on random-weight models.

Which path: the draft's own best one. build_tree keeps candidates in generation order (the proposer
emits each expanded node's k children together, best first, and parents before children), so among a
node's kept children the smallest node index is its top-scoring child (tests/test_synthetic.py checks
this on real proposals); a tree that carries drafter scores (`score`) is ranked by them first, the index
breaking ties. EAGLE-2 expands only the best k nodes per level, so that child may have no children of
its own; the walk therefore takes, at each level, the best child whose subtree still reaches depth a.
"""

from __future__ import annotations

import torch

from .tree import DraftTree
from .verify import Acceptance, _path_to


def check_profile(profile) -> list[float]:
    """The profile as floats; ValueError unless every value is in [0, 1] and none exceeds the previous."""
    values = [float(x) for x in profile]
    if not values:
        raise ValueError("the synthetic acceptance profile is empty; give at least one value")
    bad = [x for x in values if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"synthetic acceptance values must be in [0, 1], got {bad}")
    rising = [i for i in range(1, len(values)) if values[i] > values[i - 1]]
    if rising:
        i = rising[0]
        raise ValueError(
            f"synthetic acceptance must be non-increasing (share of drafts with >= i accepted tokens), "
            f"but position {i + 1} ({values[i]}) exceeds position {i} ({values[i - 1]})"
        )
    return values


def sample_depths(b: int, max_depth: int, profile: list[float], generator=None, device=None) -> torch.Tensor:
    """[b] accepted depths with P(a >= i) = profile[i-1] for i <= max_depth.

    One uniform u per row and a = #{i : u < profile[i-1]} (a prefix, the profile being non-increasing):
    the same distribution as accepting position i with conditional probability profile[i-1]/profile[i-2].
    """
    p = torch.tensor((list(profile) + [0.0] * max_depth)[:max_depth], dtype=torch.float32, device=device)
    u = torch.rand(b, generator=generator, device=device, dtype=torch.float32)
    return (u[:, None] < p[None]).to(torch.long).cumprod(1).sum(1)  # cumprod: prefix even if not monotone


def accept_synthetic(tree: DraftTree, logits: torch.Tensor, max_depth: int, profile: list[float],
                     generator=None) -> Acceptance:  # fmt: skip
    """tree of N+1 nodes per row, logits [B, N+1, V] of the target at every node.

    Returns the path [B, max_depth+1] to the last accepted node, accepted [B] (its depth) and
    next_token [B] = the target's argmax there.
    """
    b, n = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(b, device=dev)
    deepest = tree.depth.amax(1)
    want = torch.minimum(sample_depths(b, max_depth, profile, generator, dev), deepest)
    # reach[b, j] = depth of the deepest node in j's subtree (mask[b, i, j]: j is i or an ancestor of i)
    reach = torch.where(tree.mask, tree.depth[:, :, None], torch.full_like(tree.depth[:, :, None], -1)).amax(1)
    score = getattr(tree, "score", None)  # drafter scores, when the tree carries them
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    for level in range(1, int(want.max()) + 1 if b else 1):
        ok = (tree.parent == cur[:, None]) & (reach >= want[:, None])
        if score is not None:  # best score first, then the smallest index (also when scores are -inf)
            key = torch.where(ok, score.float(), torch.full_like(score, float("-inf"), dtype=torch.float32))
            ok &= key == key.amax(1, keepdim=True)
        first = ok.to(torch.int8).argmax(1)  # first True = smallest node index
        cur = torch.where(ok.any(1) & (want >= level), first, cur)
    next_token = logits[rows, cur].argmax(-1)
    return Acceptance(_path_to(tree, cur, max_depth), tree.depth[rows, cur], next_token)
