"""EAGLE-3 proposer: feeds accepted target states to the drafter and grows a draft tree (EAGLE-2).

Per step: one `extend` forward over the pairs (target aux state at position t, token t+1) accepted
since the last step, then depth-1 forwards over the top-k frontier. Frontier nodes attend to the
committed context and their own ancestors; their KV entries are dropped after the step, because the
next `extend` recomputes the accepted ones from the target's states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..kv_cache import KVCache, causal_mask
from ..models.drafter import Eagle3Drafter
from .config import TreeShape
from .tree import Candidates, DraftTree, build_tree, depth_table, root_only


class DraftShape(Protocol):
    """The shape a proposer grows a tree to: its width (top-k) and maximum depth, and two decisions,
    made with what each level showed: draft another level? how many nodes to verify (0: root only)?
    keep_drafting gets the levels so far (scores: one [B, n] tensor of cumulative log-probs per level,
    depths: their depths), the frontier's cumulative log-probs [B, K] and the conditional log-probs [B, K]
    the last level showed (a guess of the next level's); num_nodes gets every candidate's score and depth
    [B, M]. Lists, not one tensor: a fixed shape needs only the frontier, so nothing is concatenated for it."""

    top_k: int
    depth: int

    def keep_drafting(self, level: int, scores: list[torch.Tensor], depths: list[int], frontier: torch.Tensor,
                      cond: torch.Tensor) -> bool: ...  # fmt: skip

    def num_nodes(self, scores: torch.Tensor, depths: torch.Tensor, levels: int) -> int: ...


@dataclass(frozen=True)
class FixedShape:
    """A fixed tree or chain: every level up to the depth, the `num_nodes` best nodes. With
    `confidence` > 0, drafting stops once every frontier node's cumulative probability is below it and
    nodes below it are not verified (at least one node per step is kept)."""

    tree: TreeShape
    confidence: float = 0.0

    @property
    def top_k(self) -> int:
        return self.tree.top_k

    @property
    def depth(self) -> int:
        return self.tree.depth

    def keep_drafting(self, level, scores, depths, frontier, cond) -> bool:
        return self.confidence <= 0 or not bool((frontier < math.log(self.confidence)).all())

    def num_nodes(self, scores, depths, levels) -> int:
        if self.confidence <= 0:
            return self.tree.num_nodes
        return min(self.tree.num_nodes, max(1, int((scores >= math.log(self.confidence)).sum(-1).max())))


class EagleProposer:
    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.draft_to_target = drafter.draft_to_target

    def extend(self, cache: KVCache, rows, ids, aux, counts, chunk: int = 512):
        """Append pairs (aux[:, i] -> ids[:, i]) for i < counts[b]; commit them.

        ids [B, E] target token ids, aux [B, E, A*Ht] captured target states, counts [B] (host or
        device). Returns the draft logits [B, Vd] and state [B, H] at each row's last real pair.
        """
        b, e = ids.shape
        counts = counts.to(ids.device)
        last_logits = last_state = None
        for c0 in range(0, e, chunk):
            t = min(chunk, e - c0)
            cnt = (counts - c0).clamp(0, t)
            meta = cache.prepare(rows, causal_mask(cnt, t))
            base = (meta.write_pos[:, :1]).expand(b, t) + torch.arange(t, device=ids.device)
            hidden = self.drafter.project(aux[:, c0 : c0 + t])
            pick = (cnt - 1).clamp(min=0)  # only the last real pair's logits and state are used
            step_logits, step_state = self.drafter(ids[:, c0 : c0 + t], hidden, base, cache, meta, at=pick)
            cache.commit(rows, cnt.cpu())
            if last_logits is None:
                last_logits, last_state = step_logits, step_state
            else:
                has = (cnt > 0)[:, None]
                last_logits = torch.where(has, step_logits, last_logits)
                last_state = torch.where(has, step_state, last_state)
        return last_logits, last_state

    def propose(self, cache: KVCache, rows, root: torch.Tensor, logits, state, shape: DraftShape) -> DraftTree:
        """Grow the EAGLE-2 tree from the extend outputs to `shape`; root [B] is the target's last token.
        The shape decides after each level whether another one is drafted and, at the end, how many
        nodes are verified (FixedShape here, or the cost-aware policy's speculation/policy.py)."""
        depth, k = shape.depth, shape.top_k
        b, dev = root.shape[0], root.device
        d2t = self.draft_to_target
        top = logits.float().log_softmax(-1).topk(k, dim=-1)
        f_score, f_tok = top.values, d2t[top.indices]  # frontier [B, k]
        f_index = torch.arange(k, device=dev).expand(b, k)  # frontier candidate ids
        f_state = state[:, None].expand(b, k, state.shape[-1])
        cond = top.values  # [B, k] conditional log-probs of the latest level's best parent's children
        tokens, scores, parents, depths = [f_tok], [f_score], [torch.full((b, k), -1, device=dev)], [1]
        base_host = cache.lengths[:b] if rows is None else cache.lengths[rows.cpu()]
        last_pos = base_host.to(dev)[:, None] - 1  # position of the last committed pair
        anc = torch.zeros(b, k, 0, dtype=torch.bool, device=dev)
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        offset, levels = k, 1
        for level in range(1, depth):
            if not shape.keep_drafting(level, scores, depths, f_score, cond):
                break
            seen = torch.cat([anc, eye], dim=-1)  # ancestors (earlier levels) + self
            positions = (last_pos + level).expand(b, k)
            meta = cache.prepare(rows, seen, positions)  # positions: for the drafter's attention window
            out_logits, out_state = self.drafter(f_tok, f_state, positions, cache, meta)
            cache.commit(rows, torch.full((b,), k))
            levels += 1
            child = out_logits.float().log_softmax(-1).topk(k, dim=-1)
            best_parent = child.values[:, :, 0].argmax(dim=-1)
            cond = child.values[torch.arange(b, device=dev), best_parent]
            c_score = (f_score[:, :, None] + child.values).reshape(b, k * k)
            c_tok = d2t[child.indices].reshape(b, k * k)
            tokens.append(c_tok)
            scores.append(c_score)
            parents.append(f_index[:, :, None].expand(b, k, k).reshape(b, k * k))
            depths.append(level + 1)
            if level == depth - 1:
                break
            sel = c_score.topk(k, dim=-1).indices
            par = sel // k
            f_index, f_tok, f_score = offset + sel, c_tok.gather(1, sel), c_score.gather(1, sel)
            f_state = out_state.gather(1, par[:, :, None].expand(b, k, out_state.shape[-1]))
            anc = seen.gather(1, par[:, :, None].expand(b, k, seen.shape[-1]))
            offset += k * k
        cache.commit(rows, torch.full((b,), -k * (levels - 1)))  # drop the tree levels' KV
        all_scores = torch.cat(scores, 1)
        depth_t = depth_table(scores, depths)
        cand = Candidates(torch.cat(tokens, 1), all_scores, torch.cat(parents, 1), depth_t)
        num_nodes = shape.num_nodes(all_scores, depth_t, levels)
        if num_nodes == 0:
            return root_only(root)
        return build_tree(root, cand, num_nodes, levels)
