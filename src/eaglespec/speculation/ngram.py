"""Hybrid proposer pieces: prompt-lookup candidates copied from the context, merged into the draft tree.

`lookup` / `NgramIndex` find the continuation of the context's last n-gram at its most recent earlier
occurrence (prompt-lookup decoding); `merge_chains` adds one such chain per row to the EAGLE draft tree,
sharing nodes the tree already has, so the target verifies both kinds of candidates in one forward.

Difference from transformers' PromptLookupCandidateGenerator: for a given n it takes the *first*
(left-most) occurrence of the n-gram; here the *most recent* earlier one is used (recent text predicts
the next tokens better, and an index keeps it O(1) per query). Both try the largest n first, both skip
the suffix itself (an occurrence must be followed by at least one token) and both allow an occurrence
that overlaps the suffix. transformers' logits-processor filtering of candidates is not done here:
verification rejects forbidden tokens anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .tree import DraftTree, ancestor_mask


def _check_ngram(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")


def lookup(context: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Continuation copied from the context (one-shot scan, O(max_ngram * len(context)) in numpy).

    For n = max_ngram .. min_ngram: key = the last n tokens; find its most recent occurrence that is
    followed by at least one token; return up to max_tokens tokens after it (fewer at the context end).
    [] when no n matches or max_tokens <= 0. Use `NgramIndex` when called every decoding step.
    """
    _check_ngram(max_ngram, min_ngram)
    length = len(context)
    if max_tokens <= 0 or length < 2:
        return []
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        key = arr[length - n :]
        # windows starting at s = 0 .. length-n-1: each is followed by a token, none is the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == key).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + max_tokens].tolist()
    return []


class NgramIndex:
    """Incremental prompt-lookup index over one row's tokens (prompt + accepted output).

    `append` costs O(max_ngram) dict updates per token; `lookup` is O(max_ngram) dict probes plus the
    copy of the continuation, independent of the context length. Memory: up to
    (max_ngram - min_ngram + 1) * len(tokens) tuple keys (about 0.1-0.2 KB each in CPython).
    Answers equal `lookup(self.tokens, ...)` with the same n-gram range.
    """

    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = 3, min_ngram: int = 1):
        _check_ngram(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # n-gram -> index of the token after its latest occurrence that is followed by a token
        self._next: dict[tuple[int, ...], int] = {}
        self.append(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Iterable[int]) -> None:
        """Add accepted tokens at the end (ints, or a list/1-D tensor of them)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        toks, nxt = self.tokens, self._next
        lo, hi = self.min_ngram, self.max_ngram
        for t in tokens:
            end = len(toks)
            # the n-grams ending at the current last token get followed by t: they become "earlier" occurrences
            for n in range(lo, min(hi, end) + 1):
                nxt[tuple(toks[end - n : end])] = end
            toks.append(int(t))

    def lookup(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens after the most recent earlier occurrence of the longest matching suffix."""
        if max_tokens <= 0:
            return []
        toks = self.tokens
        length = len(toks)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._next.get(tuple(toks[length - n :]))
            if start is not None:
                return toks[start : start + max_tokens]
        return []


def merge_chains(tree: DraftTree, chains: Sequence[Sequence[int]]) -> tuple[DraftTree, torch.Tensor]:
    """Add row b's chain (target ids, chains[b][0] a child of the root) to row b of the tree.

    tree: N+1 nodes per row. The chain follows existing nodes while their tokens match (the first
    child in index order with that token) and appends new nodes from the first mismatch on, so existing
    node i stays node i and parents precede children. Rows are padded to the same count N'+1 with
    copies of the row's last node (a leaf, since parents precede children; the root when the row has
    no other node): same token, parent and depth, placed after their twin, so acceptance never picks a
    copy over it (greedy: first node of maximal depth; sampling: a copy is tried after its twin, which
    either was accepted or left residual probability 0 for that token).

    Returns the merged DraftTree (tokens, parent, depth [B, N'+1], mask [B, N'+1, N'+1] built with the
    new max depth; score [B, N'+1] with -inf at added and padding nodes, or None if tree.score is None)
    and from_context [B, N'+1] bool: True exactly at the nodes added from the chains.
    """
    b, n1 = tree.tokens.shape
    if len(chains) != b:
        raise ValueError(f"need one chain per row: {len(chains)} chains for {b} rows")
    dev = tree.tokens.device
    tokens, parent, depth = tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist()
    added = []
    for r in range(b):
        # (parent, token) -> first child with that token; built backwards so the smallest index wins
        kids = {(parent[r][i], tokens[r][i]): i for i in range(n1 - 1, 0, -1)}
        cur, i, chain = 0, 0, [int(t) for t in chains[r]]
        while i < len(chain) and (cur, chain[i]) in kids:
            cur = kids[(cur, chain[i])]
            i += 1
        new = []
        d = depth[r][cur]
        for tok in chain[i:]:  # new nodes have no children yet: no further sharing possible
            d += 1
            new.append((tok, cur, d))
            cur = n1 + len(new) - 1
        added.append(new)
    extra = max((len(a) for a in added), default=0)
    from_context = torch.zeros(b, n1 + extra, dtype=torch.bool)
    if extra == 0:
        return DraftTree(tree.tokens, tree.parent, tree.depth, tree.mask, tree.score), from_context.to(dev)
    for r, new in enumerate(added):
        from_context[r, n1 : n1 + len(new)] = True
        last = new[-1] if new else (tokens[r][-1], parent[r][-1], depth[r][-1])
        new += [last] * (extra - len(new))  # padding: copies of the row's last node
        tokens[r] += [t for t, _, _ in new]
        parent[r] += [p for _, p, _ in new]
        depth[r] += [d for _, _, d in new]
    tok_t = torch.tensor(tokens, dtype=tree.tokens.dtype, device=dev)
    par_t = torch.tensor(parent, dtype=tree.parent.dtype, device=dev)
    dep_t = torch.tensor(depth, dtype=tree.depth.dtype, device=dev)
    max_depth = max(max(row) for row in depth)
    score = None
    if tree.score is not None:  # copied and padding nodes are not the drafter's: -inf keeps them out of calibration
        score = torch.cat([tree.score, torch.full((b, extra), float("-inf"), dtype=tree.score.dtype, device=dev)], 1)
    return DraftTree(tok_t, par_t, dep_t, ancestor_mask(par_t, max_depth), score), from_context.to(dev)
