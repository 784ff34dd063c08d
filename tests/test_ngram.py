"""Prompt-lookup candidates (lookup, NgramIndex) and their merge into the draft tree (merge_chains)."""

import random
import time

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from eaglespec.speculation.ngram import NgramIndex, lookup, merge_chains
from eaglespec.speculation.tree import DraftTree, ancestor_mask, root_only
from eaglespec.speculation.verify import accept_greedy


def _brute(ctx, max_tokens, max_ngram=3, min_ngram=1, prefer="last"):
    """Reference prompt lookup by plain loops; prefer='first' is transformers' choice of occurrence."""
    n_ctx = len(ctx)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= n_ctx:
            continue
        starts = range(n_ctx - n - 1, -1, -1) if prefer == "last" else range(n_ctx - n)
        for s in starts:
            if ctx[s : s + n] == ctx[n_ctx - n :]:
                return ctx[s + n : s + n + max_tokens]
    return []


# -- lookup -------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["scan", "index"])
def test_lookup_rules(impl):
    def f(ctx, k, hi=3, lo=1):
        return lookup(ctx, k, hi, lo) if impl == "scan" else NgramIndex(ctx, hi, lo).lookup(k)

    # longest n-gram wins: [5, 2] occurred at 0 (-> 7 8 ...), [2] alone most recently at 5 (-> 9 ...)
    ctx = [5, 2, 7, 8, 1, 2, 9, 5, 2]
    assert f(ctx, 3) == [7, 8, 1]
    assert f(ctx, 3, hi=1) == [9, 5, 2]
    assert f(ctx, 3, hi=3, lo=3) == []  # [9, 5, 2] never occurred before
    # most recent occurrence wins
    assert f([1, 4, 1, 6, 1], 5) == [6, 1]
    # no match, empty and one-token contexts, max_tokens <= 0
    assert f([1, 2, 3], 4) == [] and f([], 4) == [] and f([3], 4) == [] and f([1, 1], 0) == []
    # max_tokens cap; the continuation stops at the context end
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    assert f(ctx, 2) == [3, 4]
    assert f(ctx, 100) == [3, 4, 5, 6, 1, 2]
    # an occurrence may overlap the suffix (as in transformers); the suffix itself never matches
    assert f([7, 7, 7], 5) == [7]
    assert f([7, 7], 5) == [7]


def test_lookup_rejects_bad_ngram_range():
    with pytest.raises(ValueError):
        lookup([1, 2], 3, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramIndex(min_ngram=0)


def test_index_and_scan_match_brute_force_on_random_contexts():
    rng = random.Random(0)
    for _ in range(600):
        alphabet = rng.randint(1, 4)
        ctx = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        hi = rng.randint(1, 4)
        lo = rng.randint(1, hi)
        k = rng.randint(1, 6)
        want = _brute(ctx, k, hi, lo)
        assert lookup(ctx, k, hi, lo) == want, (ctx, k, hi, lo)
        assert NgramIndex(ctx, hi, lo).lookup(k) == want, (ctx, k, hi, lo)


def test_index_incremental_appends_match_brute_force():
    rng = random.Random(1)
    for _ in range(60):
        hi = rng.randint(1, 4)
        lo = rng.randint(1, hi)
        idx = NgramIndex(max_ngram=hi, min_ngram=lo)
        ctx = []
        while len(ctx) < 60:
            chunk = [rng.randrange(3) for _ in range(rng.randint(0, 5))]  # accepted tokens of one step
            ctx += chunk
            idx.append(torch.tensor(chunk, dtype=torch.long) if rng.random() < 0.3 else chunk)
            assert len(idx) == len(ctx) and idx.tokens == ctx
            for k in (1, 4):
                assert idx.lookup(k) == _brute(ctx, k, hi, lo), (ctx, k, hi, lo)


def test_ngram_choice_matches_transformers_prompt_lookup():
    """Same n-gram size, stop rules and overlap rule as transformers; only the occurrence differs
    (transformers: first, here: most recent), so transformers equals the brute force with prefer='first'."""
    rng = random.Random(2)
    for _ in range(200):
        ctx = [rng.randrange(3) for _ in range(rng.randint(2, 25))]
        hi, k = rng.randint(1, 3), rng.randint(1, 5)
        gen = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=hi, max_length=1000)
        out, _ = gen.get_candidates(torch.tensor([ctx]))
        hf = out[0, len(ctx) :].tolist()
        assert hf == _brute(ctx, k, hi, 1, prefer="first"), ctx
        assert lookup(ctx, k, hi) == _brute(ctx, k, hi, 1, prefer="last"), ctx


def test_index_is_fast_on_long_contexts():
    rng = random.Random(3)
    ctx = [rng.randrange(2000) for _ in range(20000)]
    t0 = time.perf_counter()
    idx = NgramIndex(ctx)
    for step in range(500):  # decoding: a few accepted tokens, then one query per step
        idx.append(ctx[step * 7 : step * 7 + 3])
        idx.lookup(8)
    assert time.perf_counter() - t0 < 5.0  # generous: shared CPUs; typically ~0.05 s
    assert idx.lookup(8) == _brute(idx.tokens, 8)
    assert lookup(idx.tokens, 8) == idx.lookup(8)


# -- merge_chains -------------------------------------------------------------------------------


def _tree(tokens, parent):
    tokens, parent = torch.tensor(tokens), torch.tensor(parent)
    depth = torch.zeros_like(parent)
    for i in range(1, parent.shape[1]):
        depth[:, i] = torch.where(parent[:, i] >= 0, depth.gather(1, parent[:, i : i + 1].clamp(min=0))[:, 0] + 1, 0)
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, int(depth.max())))


def _hand(b=3):
    # root(0) -> 1:a=4 -> 3:c=5 ; 1 -> 4:d=6 ; root -> 2:b=2
    return _tree([[0, 4, 2, 5, 6]] * b, [[-1, 0, 0, 1, 1]] * b)


def _check_wellformed(t):
    n = t.tokens.shape[1]
    idx = torch.arange(n)
    assert (t.parent[:, 0] == -1).all() and (t.depth[:, 0] == 0).all()
    assert (t.parent[:, 1:] < idx[1:]).all() and (t.parent[:, 1:] >= 0).all()  # parents precede children
    assert torch.equal(t.depth[:, 1:], t.depth.gather(1, t.parent[:, 1:]) + 1)
    assert torch.equal(t.mask, ancestor_mask(t.parent, n))
    # mask by walking up explicitly
    for r in range(t.tokens.shape[0]):
        for i in range(n):
            anc, j = {i}, i
            while t.parent[r, j] >= 0:
                j = int(t.parent[r, j])
                anc.add(j)
            assert set(torch.nonzero(t.mask[r, i])[:, 0].tolist()) == anc


def test_chain_inside_tree_adds_nothing():
    t = _hand(2)
    m, fc = merge_chains(t, [[4, 5], []])
    assert torch.equal(m.tokens, t.tokens) and torch.equal(m.parent, t.parent) and torch.equal(m.mask, t.mask)
    assert fc.shape == (2, 5) and not fc.any()


def test_merge_diverging_chains_and_padding():
    t = _hand(4)
    chains = [
        [4, 7, 8],  # shares a, diverges at depth 2: 5:7 under node 1, 6:8 under node 5
        [],  # nothing: padded with copies of its last node (4:d=6 under 1)
        [9],  # new child of the root
        [2, 3, 2, 3, 2],  # shares b, then 4 new nodes under it: depths 2..5
    ]
    m, fc = merge_chains(t, chains)
    assert m.tokens.shape == (4, 9)
    _check_wellformed(m)
    assert torch.equal(m.tokens[:, :5], t.tokens) and torch.equal(m.parent[:, :5], t.parent)  # old nodes stay
    assert m.tokens[0, 5:7].tolist() == [7, 8] and m.parent[0, 5:7].tolist() == [1, 5]
    assert m.depth[0, 5:7].tolist() == [2, 3]
    assert m.tokens[2, 5].tolist() == 9 and m.parent[2, 5] == 0 and m.depth[2, 5] == 1
    assert m.parent[3, 5:9].tolist() == [2, 5, 6, 7] and m.depth[3, 5:9].tolist() == [2, 3, 4, 5]
    assert m.tokens[3, 5:9].tolist() == [3, 2, 3, 2]
    # padding = copies of the row's last node (same token, parent, depth)
    for r, last in [(0, 6), (1, 4), (2, 5)]:
        for j in range(last + 1, 9):
            assert (m.tokens[r, j], m.parent[r, j], m.depth[r, j]) == (
                m.tokens[r, last], m.parent[r, last], m.depth[r, last])  # fmt: skip
    want = torch.zeros(4, 9, dtype=torch.bool)
    want[0, 5:7] = want[2, 5] = want[3, 5:9] = True
    assert torch.equal(fc, want)
    assert m.score is None


def test_merge_keeps_scores_and_marks_copies_minus_inf():
    t = _hand(2)
    t.score = torch.tensor([[0.0, -0.1, -0.2, -0.3, -0.4]] * 2)
    m, fc = merge_chains(t, [[4, 7], []])
    assert torch.equal(m.score[:, :5], t.score)
    assert m.score[:, 5].tolist() == [float("-inf")] * 2  # row 0: copied node, row 1: padding copy
    m2, _ = merge_chains(t, [[4], [2]])  # nothing added: the tree comes back as it was
    assert m2.score is t.score and m2.tokens is t.tokens


def test_merge_into_root_only_tree():
    root = torch.tensor([3, 4, 5])
    m, fc = merge_chains(root_only(root), [[1, 2], [], [6]])
    # padding of a root-only row is a root copy (parent -1, depth 0): the only non-leaf-copy case
    assert m.tokens.tolist() == [[3, 1, 2], [4, 4, 4], [5, 6, 6]]
    assert m.parent.tolist() == [[-1, 0, 1], [-1, -1, -1], [-1, 0, 0]]
    assert m.depth.tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 1]]
    assert fc.tolist() == [[False, True, True], [False] * 3, [False, True, False]]
    assert torch.equal(m.mask, ancestor_mask(m.parent, 2))
    # a root copy is never accepted: the root wins the tie at depth 0
    logits = torch.randn(3, 3, 8)
    acc = accept_greedy(m, logits, 2)
    assert acc.path[1].tolist() == [0, 0, 0] and acc.accepted[1] == 0 and acc.next_token[1] == logits[1, 0].argmax()


def test_merge_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        merge_chains(_hand(2), [[1]])


# -- padding is lossless ------------------------------------------------------------------------


def _random_tree(rng, b, n, vocab):
    """b rows of random trees with n draft nodes, distinct sibling tokens, parents first."""
    tokens, parent = [], []
    for _ in range(b):
        tok, par = [rng.randrange(vocab)], [-1]
        for i in range(1, n + 1):
            free = {p: [v for v in range(vocab) if v not in {tok[j] for j in range(1, i) if par[j] == p}]
                    for p in range(i)}  # fmt: skip
            p = rng.choice([q for q in range(i) if free[q]])  # node i-1 has no children yet: never empty
            tok.append(rng.choice(free[p]))
            par.append(p)
        tokens.append(tok)
        parent.append(par)
    return _tree(tokens, parent)


def _random_chain(rng, tree, r, vocab):
    """Follow a random path of row r for a while, then continue with random tokens."""
    par, tok = tree.parent[r].tolist(), tree.tokens[r].tolist()
    chain, cur = [], 0
    while rng.random() < 0.7:
        kids = [i for i in range(1, len(par)) if par[i] == cur]
        if not kids:
            break
        cur = rng.choice(kids)
        chain.append(tok[cur])
    return chain + [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3, 5]))]


def test_greedy_padding_is_lossless():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    vocab, b, trials = 5, 6, 150
    accepted_on_pad_twin = 0
    for _ in range(trials):
        t = _random_tree(rng, b, rng.randint(1, 8), vocab)
        m, fc = merge_chains(t, [_random_chain(rng, t, r, vocab) for r in range(b)])
        n = m.tokens.shape[1]
        # rig the logits so the argmax follows some child most of the time (long accepted paths)
        logits = torch.randn(b, n, vocab, generator=gen)
        for r in range(b):
            for i in range(n):
                kids = (m.parent[r] == i).nonzero()[:, 0].tolist()
                if kids and rng.random() < 0.8:
                    logits[r, i, m.tokens[r, rng.choice(kids)]] += 10
        max_d = int(m.depth.max())
        acc = accept_greedy(m, logits, max_d)
        seq = m.tokens.gather(1, acc.path)
        for r in range(b):
            # unpadded row: the nodes up to and including the row's last real node
            last_real = max([i for i in range(n) if fc[r, i]] + [t.tokens.shape[1] - 1])
            real = last_real + 1
            sub = DraftTree(m.tokens[r : r + 1, :real], m.parent[r : r + 1, :real], m.depth[r : r + 1, :real],
                            ancestor_mask(m.parent[r : r + 1, :real], max_d))  # fmt: skip
            ref = accept_greedy(sub, logits[r : r + 1, :real], max_d)
            a = int(acc.accepted[r])
            got = seq[r, 1 : a + 1].tolist() + [int(acc.next_token[r])]
            want = sub.tokens[0].gather(0, ref.path[0])[1 : int(ref.accepted[0]) + 1].tolist() + [
                int(ref.next_token[0])
            ]
            assert got == want
            assert (acc.path[r] < real).all()  # a padding copy is never on the path
            accepted_on_pad_twin += int(real < n and (acc.path[r] == real - 1).any())
    assert accepted_on_pad_twin > 20  # the padded leaf's twin was accepted often: the test has teeth
