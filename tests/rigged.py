"""A proposer rigged to put the target's true greedy continuation into the tree (plus wrong siblings),
so long accepted paths and cache compaction are exercised through the real tree builder."""

from __future__ import annotations

import torch

from eaglespec.speculation.proposer import EagleProposer
from eaglespec.speculation.tree import Candidates, build_tree


class RiggedProposer(EagleProposer):
    def __init__(self, engine, truth: list[list[int]], vocab: int, break_every: int = 0):
        super().__init__(engine.drafter)
        self.shape = engine.shape
        self.engine, self.truth, self.vocab, self.break_every = engine, truth, vocab, break_every

    def propose(self, cache, rows, root, logits, state, **_):
        depth = self.shape.depth
        toks, scores, parents, depths = [], [], [], []
        for r in self.engine.core.running:  # the rows this step decodes
            done = len(r.output)
            true = (self.truth[r.id][done : done + depth] + [0] * depth)[:depth]
            if self.break_every and done % self.break_every == 1:  # vary accept lengths
                cut = done % depth
                true = true[:cut] + [(t + 1) % self.vocab for t in true[cut:]]
            t_row, s_row, p_row, d_row = [], [], [], []
            prev_true, prev_wrong = -1, -1
            for level in range(depth):
                wrong = (true[level] + 1) % self.vocab
                base = len(t_row)
                t_row += [true[level], wrong, (wrong + 1) % self.vocab]
                s_row += [-0.1 * (level + 1), -2.0 - level, -3.0 - level]
                p_row += [prev_true, prev_true, prev_wrong]
                d_row += [level + 1] * 3
                prev_true, prev_wrong = base, base + 1
            p_row[2] = -1  # level-1 third candidate hangs off the root
            toks.append(t_row), scores.append(s_row), parents.append(p_row), depths.append(d_row)
        dev = root.device
        cand = Candidates(*(torch.tensor(x, device=dev) for x in (toks, scores, parents, depths)))
        cand.scores = cand.scores.float()
        return build_tree(root, cand, self.shape.num_nodes, depth)
