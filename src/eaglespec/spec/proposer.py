"""EAGLE-3 proposer: feeds accepted target states to the drafter and grows a draft tree (EAGLE-2).

Per step: one `extend` forward over the pairs (target aux state at position t, token t+1) accepted
since the last step, then depth-1 forwards over the top-k frontier. Frontier nodes attend to the
committed context and their own ancestors; their KV entries are dropped after the step, because the
next `extend` recomputes the accepted ones from the target's states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv_cache import KVCache
from ..models.drafter import Eagle3Drafter
from .tree import Candidates, DraftTree, build_tree


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


def causal_mask(counts: torch.Tensor, t: int) -> torch.Tensor:
    """[B, T, T] causal mask over T new tokens of which the first counts[b] are real."""
    idx = torch.arange(t, device=counts.device)
    valid = idx[None, :] < counts[:, None]
    causal = idx[None, :, None] >= idx[None, None, :]
    return (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=counts.device)[None]


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

    def propose(self, cache: KVCache, rows, root: torch.Tensor, logits, state) -> DraftTree:
        """Grow the EAGLE-2 tree from the extend outputs; root [B] is the target's last token."""
        depth, k = self.shape.depth, self.shape.top_k
        b, dev = root.shape[0], root.device
        d2t = self.draft_to_target
        top = logits.float().log_softmax(-1).topk(k, dim=-1)
        f_score, f_tok = top.values, d2t[top.indices]  # frontier [B, k]
        f_index = torch.arange(k, device=dev).expand(b, k)  # frontier candidate ids
        f_state = state[:, None].expand(b, k, state.shape[-1])
        tokens, scores, parents, depths = [f_tok], [f_score], [torch.full((b, k), -1, device=dev)], [1]
        base_host = cache.lengths[:b] if rows is None else cache.lengths[rows.cpu()]
        last_pos = base_host.to(dev)[:, None] - 1  # position of the last committed pair
        anc = torch.zeros(b, k, 0, dtype=torch.bool, device=dev)
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        offset = k
        for level in range(1, depth):
            seen = torch.cat([anc, eye], dim=-1)  # ancestors (earlier levels) + self
            meta = cache.prepare(rows, seen)
            out_logits, out_state = self.drafter(f_tok, f_state, (last_pos + level).expand(b, k), cache, meta)
            cache.commit(rows, torch.full((b,), k))
            child = out_logits.float().log_softmax(-1).topk(k, dim=-1)
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
        cache.commit(rows, torch.full((b,), -k * (depth - 1)))  # drop the tree levels' KV
        depth_t = torch.cat([torch.full_like(t, d) for t, d in zip(tokens, depths)], dim=1)
        cand = Candidates(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), depth_t)
        return build_tree(root, cand, self.shape.num_nodes, depth)
