"""EAGLE-3 proposer: feeds accepted target states to the drafter and grows a draft tree (EAGLE-2).

Per step: one `extend` forward over the pairs (target aux state at position t, token t+1) accepted
since the last step, then depth-1 forwards over the top-k frontier. Frontier nodes attend to the
committed context and their own ancestors; their KV entries are dropped after the step, because the
next `extend` recomputes the accepted ones from the target's states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kv_cache import KVCache, causal_mask
from ..models.drafter import Eagle3Drafter
from .tree import Candidates, DraftTree, build_tree, root_only


@dataclass(frozen=True)
class TreeShape:
    """depth: max draft tokens on a path; top_k: children per expanded node and frontier width;
    num_nodes: draft tokens kept for verification. A chain is top_k=1, num_nodes=depth."""

    depth: int = 4
    top_k: int = 4
    num_nodes: int = 16

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.num_nodes < 1:
            raise ValueError(f"tree depth, top-k and node count must be >= 1, got {self}")

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(depth=k, top_k=1, num_nodes=k)

    @property
    def max_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def kept_nodes(self) -> int:
        return min(self.num_nodes, self.max_candidates)


class EagleProposer:
    def __init__(self, drafter: Eagle3Drafter, shape: TreeShape):
        self.drafter = drafter
        self.shape = shape
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
            normed, state = self.drafter(ids[:, c0 : c0 + t], hidden, base, cache, meta, with_logits=False)
            cache.commit(rows, cnt.cpu())
            pick = (cnt - 1).clamp(min=0)
            last = normed.gather(1, pick[:, None, None].expand(b, 1, normed.shape[-1]))[:, 0]
            step_logits = self.drafter.lm_head(last)  # only the last real pair's logits are used
            step_state = state.gather(1, pick[:, None, None].expand(b, 1, state.shape[-1]))[:, 0]
            if last_logits is None:
                last_logits, last_state = step_logits, step_state
            else:
                has = (cnt > 0)[:, None]
                last_logits = torch.where(has, step_logits, last_logits)
                last_state = torch.where(has, step_state, last_state)
        return last_logits, last_state

    def propose(self, cache: KVCache, rows, root: torch.Tensor, logits, state, *, width: int | None = None,
                policy=None, confidence: float = 0.0) -> DraftTree:  # fmt: skip
        """Grow the EAGLE-2 tree from the extend outputs; root [B] is the target's last token.

        Fixed shape (policy None): self.shape's depth, top-k and node count; with `confidence` > 0,
        drafting stops once every frontier node's cumulative probability is below it and nodes below
        it are not verified (at least one node per step is kept). With a Policy (speculation/policy.py):
        self.shape.depth is the maximum depth, `width` the top-k, and the policy decides after each
        level whether another one pays and how many nodes to verify (possibly none: root only).
        """
        depth, k = self.shape.depth, width or self.shape.top_k
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
        log_conf = math.log(confidence) if confidence > 0 else None
        for level in range(1, depth):
            if policy is not None:
                q = policy.acceptance.eagle_q(torch.cat(scores, 1), _depth_table(scores, depths))
                # the next level's children, guessed from the conditional log-probs this level showed
                guess = (f_score[:, :, None] + cond[:, None, :]).reshape(b, k * k)
                nxt = policy.acceptance.eagle_q(guess, torch.full_like(guess, level + 1, dtype=torch.long))
                if not policy.keep_drafting(level, q, nxt, policy.draft_seconds(level, k)):
                    break
            elif log_conf is not None and bool((f_score < log_conf).all()):
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
        depth_t = _depth_table(scores, depths)
        cand = Candidates(torch.cat(tokens, 1), all_scores, torch.cat(parents, 1), depth_t)
        if policy is not None:
            q = policy.acceptance.eagle_q(all_scores, depth_t)
            num_nodes = policy.node_count(q, policy.draft_seconds(levels, k))
        elif log_conf is not None:
            num_nodes = min(self.shape.num_nodes, max(1, int((all_scores >= log_conf).sum(-1).max())))
        else:
            num_nodes = self.shape.num_nodes
        if num_nodes == 0:
            return root_only(root)
        return build_tree(root, cand, num_nodes, levels)


def _depth_table(scores: list[torch.Tensor], depths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full(s.shape, d, dtype=torch.long, device=s.device) for s, d in zip(scores, depths)], 1)
