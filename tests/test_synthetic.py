"""Synthetic acceptance: depth distribution follows the profile, tree-depth cap, valid paths, the
target's argmax as next token, the top-1-child ordering it relies on, and engine-level tau."""

import pytest
import torch

from eaglespec.engine import Engine, Request
from eaglespec.sampling import SamplingParams
from eaglespec.speculation import proposer as proposer_mod
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.synthetic import accept_synthetic, check_profile, sample_depths
from eaglespec.speculation.tree import DraftTree, ancestor_mask, build_tree
from helpers import random_drafter, tiny_target

PROFILE = [0.851, 0.645, 0.570, 0.504]  # a vLLM per-position acceptance (EAGLE-3.1 on chat)


def make_tree(parent: torch.Tensor, vocab: int = 50, seed: int = 0) -> DraftTree:
    """parent [B, n] with parent[:, i] < i (root: -1) -> DraftTree with random tokens."""
    b, n = parent.shape
    depth = torch.zeros(b, n, dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth.gather(1, parent[:, i : i + 1])[:, 0] + 1
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, int(depth.max())))


def chain_tree(b: int, k: int) -> DraftTree:
    return make_tree(torch.arange(-1, k).expand(b, k + 1).clone())


def random_trees(b: int, n: int, seed: int = 0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parent = torch.full((b, n), -1, dtype=torch.long)
    for i in range(1, n):
        parent[:, i] = (torch.rand(b, generator=g) * i).long()  # any earlier node
    return make_tree(parent, seed=seed)


def test_depth_distribution_matches_profile():
    b = 20_000
    tree = chain_tree(b, 6)
    logits = torch.randn(b, 7, 8)
    acc = accept_synthetic(tree, logits, 6, PROFILE, torch.Generator().manual_seed(0))
    observed = [(acc.accepted >= i).float().mean().item() for i in range(1, 7)]
    # binomial std <= 0.0036 at 20k rows; positions past the profile have acceptance 0
    assert observed == pytest.approx(PROFILE + [0.0, 0.0], abs=0.015)
    # chi-square over the outcome counts a = 0..4 (4 degrees of freedom, 99.9% quantile 18.5)
    expect = torch.tensor([1 - PROFILE[0], *(PROFILE[i] - PROFILE[i + 1] for i in range(3)), PROFILE[3]]) * b
    counts = torch.bincount(acc.accepted, minlength=5)[:5].double()
    assert float(((counts - expect) ** 2 / expect).sum()) < 18.5


def test_sample_depths_edge_profiles():
    g = torch.Generator().manual_seed(1)
    assert sample_depths(100, 4, [1.0, 1.0, 1.0, 1.0], g).tolist() == [4] * 100
    assert sample_depths(100, 4, [0.0], g).tolist() == [0] * 100
    assert sample_depths(100, 2, [1.0, 1.0, 1.0], g).tolist() == [2] * 100  # capped by max_depth


def test_capped_by_the_deepest_node_of_each_row():
    # row 0: root -> 1 -> 2 (depth 2) plus a sibling 3 of node 1; row 1: a 3-chain
    parent = torch.tensor([[-1, 0, 1, 0], [-1, 0, 1, 2]])
    tree = make_tree(parent)
    acc = accept_synthetic(tree, torch.randn(2, 4, 10), 4, [1.0, 1.0, 1.0, 1.0])
    assert acc.accepted.tolist() == [2, 3]
    assert acc.path.tolist() == [[0, 1, 2, 2, 2], [0, 1, 2, 3, 3]]


def test_paths_are_valid_and_next_token_is_the_argmax():
    b, n, depth = 2000, 12, 11
    tree = random_trees(b, n)
    logits = torch.randn(b, n, 30)
    acc = accept_synthetic(tree, logits, depth, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], torch.Generator().manual_seed(2))
    rows = torch.arange(b)
    assert acc.path.shape == (b, depth + 1)
    assert (acc.path[:, 0] == 0).all()
    last = acc.path[rows, acc.accepted]
    for k in range(1, depth + 1):
        on = acc.accepted >= k
        node, prev = acc.path[:, k], acc.path[:, k - 1]
        assert (tree.parent[rows, node][on] == prev[on]).all()  # each node's parent is the previous one
        assert (tree.depth[rows, node][on] == k).all()
        assert (node[~on] == last[~on]).all()  # padded by repeating the last accepted node
    assert torch.equal(acc.accepted, tree.depth[rows, last])
    assert torch.equal(acc.next_token, logits[rows, last].argmax(-1))
    assert acc.accepted.float().mean() > 1.0  # the walk does get deep


def test_walk_takes_the_first_child_that_reaches_the_sampled_depth():
    # root's first child (node 1) is a leaf; the second (node 2) has a child; a = 2 must go through node 2,
    # a = 1 must take node 1
    tree = make_tree(torch.tensor([[-1, 0, 0, 2]]))
    logits = torch.randn(1, 4, 5)
    assert accept_synthetic(tree, logits, 2, [1.0, 1.0]).path.tolist() == [[0, 2, 3]]
    assert accept_synthetic(tree, logits, 2, [1.0, 0.0]).path.tolist() == [[0, 1, 1]]


def test_first_kept_child_is_the_top_scoring_child(tmp_path, monkeypatch):
    """What the path choice relies on: in build_tree's output, siblings come in score order."""
    target, _, _ = tiny_target(tmp_path, "llama")
    seen = []

    def spy(root, cand, num_nodes, max_depth):
        seen.append((cand, num_nodes))
        return build_tree(root, cand, num_nodes, max_depth)

    monkeypatch.setattr(proposer_mod, "build_tree", spy)
    eng = Engine(target, random_drafter(target, scale=0.5), mode="tree", tree=TreeShape(4, 3, 10), adaptive=False)
    eng.generate([Request([3, 1, 4, 1, 5], 12), Request([2, 7, 1], 12)], batch_size=2)
    assert seen
    for cand, num_nodes in seen:
        key = cand.scores - 1e-6 * cand.depth
        keep = key.topk(num_nodes, dim=-1).indices.sort(dim=-1).values  # as build_tree keeps them
        scores = cand.scores.gather(1, keep)
        tree = build_tree(torch.zeros(keep.shape[0], dtype=torch.long), cand, num_nodes, 4)
        parent = tree.parent[:, 1:]
        for b in range(keep.shape[0]):
            for p in parent[b].unique().tolist():
                kids = scores[b][parent[b] == p]  # in node-index order
                assert (kids[:-1] >= kids[1:]).all(), (p, kids)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_engine_tau_follows_the_profile(tmp_path, mode):
    profile = [0.8, 0.6, 0.45, 0.3]
    target, _, _ = tiny_target(tmp_path, "llama")
    # tree 4/2/14 keeps all 14 candidates, so every row's tree reaches depth 4 (no cap)
    eng = Engine(target, random_drafter(target), mode=mode, chain_k=4, tree=TreeShape(4, 2, 14), adaptive=False,
                 synthetic_acceptance=profile)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, 96, (6,), generator=g).tolist(), 150) for _ in range(6)]
    out = eng.generate(reqs, SamplingParams(seed=0), batch_size=3)
    s = out.stats
    assert s.drafts > 250
    assert s.tau == pytest.approx(1 + sum(profile), abs=0.2)
    assert s.per_position_acceptance == pytest.approx(profile, abs=0.07)
    assert all(len(r.output_ids) == 150 for r in out.results)


def test_check_profile():
    assert check_profile(["0.9", 0.8, 0.8]) == [0.9, 0.8, 0.8]
    for bad, msg in [([], "empty"), ([0.9, 1.2], r"\[0, 1\]"), ([-0.1], r"\[0, 1\]"), ([0.5, 0.6], "non-increasing")]:
        with pytest.raises(ValueError, match=msg):
            check_profile(bad)
