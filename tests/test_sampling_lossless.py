"""Speculative sampling must reproduce the target distribution exactly (chi-square, fixed seeds)."""

import pytest
import torch
from scipy.stats import chisquare

from eaglespec.engine import Engine, Request
from eaglespec.models.checkpoint import load_target
from eaglespec.sampling import BatchSampling, SamplingParams, target_probs, token_scores
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.costs import StepCosts
from eaglespec.speculation.tree import DraftTree, ancestor_mask
from eaglespec.speculation.verify import accept_greedy
from helpers import hf_tiny, random_drafter, save_hf

V = 16
PROMPT = [3, 7, 1, 12, 5]


def _chi2(counts, expected_p):
    """p-value of counts vs probabilities, merging cells with expected count < 5."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    exp = torch.as_tensor(expected_p, dtype=torch.float64).flatten() * counts.sum()
    small = exp < 5
    if counts[exp == 0].sum() > 0:  # a token with zero probability was produced: certainly wrong
        return 0.0
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    ex = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    ex = ex * obs.sum() / ex.sum()
    return chisquare(obs.numpy(), ex.numpy()).pvalue


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = hf_tiny("llama", vocab=V, hidden=32, layers=3, heads=4, kv_heads=2, init_range=0.08, seed=4)
    target = load_target(save_hf(hf, tmp_path_factory.mktemp("s") / "m"))
    return target, hf


def _exact(hf, params, prompt=PROMPT):
    """Exact marginals of generated tokens 1, 2, 3 under the processed target distribution."""
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        seq2 = torch.tensor([prompt + [a] for a in range(V)])
        p2 = target_probs(hf(seq2).logits[:, -1], params)  # [V(t1), V(t2)]
        seq3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = target_probs(hf(seq3).logits[:, -1], params).view(V, V, V)
    joint12 = p1[:, None] * p2
    m3 = (joint12[:, :, None] * p3).sum((0, 1))
    return p1, joint12.sum(0), m3, joint12


N = 3000


REPEATS = [3, 7, 1, 12, 3, 7]  # "3 7" recurs: the hybrid proposer copies "1 12 3 7 ..." into the tree


@pytest.mark.parametrize(
    "mode,params,confidence,ngram,prompt",
    [
        ("tree", SamplingParams(temperature=1.0, seed=11), 0.0, 0, PROMPT),
        ("chain", SamplingParams(temperature=0.8, top_p=0.9, seed=12), 0.0, 0, PROMPT),
        ("tree", SamplingParams(temperature=0.8, top_k=6, seed=13), 0.0, 0, PROMPT),
        ("chain", SamplingParams(temperature=1.0, top_p=0.85, top_k=10, seed=14), 0.0, 0, PROMPT),
        ("tree", SamplingParams(temperature=1.0, seed=15), 0.15, 0, PROMPT),  # confidence-truncated drafts
        ("auto", SamplingParams(temperature=0.9, seed=16), 0.0, None, PROMPT),  # the cost-aware policy's trees
        ("tree", SamplingParams(temperature=0.7, seed=17), 0.0, 4, REPEATS),  # hybrid: copied + drafted nodes
    ],
)
def test_speculative_sampling_matches_target(model, mode, params, confidence, ngram, prompt, monkeypatch):
    target, hf = model
    if mode == "auto":  # fixed costs of a machine where verifying more nodes is cheap: the policy's trees,
        # not whether this (shared, busy) machine's calibration happens to make them pay, are under test
        import eaglespec.speculation.policies as engine_module

        def cheap(target, drafter, batch, **_):
            return StepCosts(batch, {n: 0.01 + 1e-5 * n for n in (1, 2, 4, 8, 16, 32)}, {k: 1e-3 for k in (1, 2, 4, 8)})

        monkeypatch.setattr(engine_module, "load_or_calibrate", cheap)
    drafter = random_drafter(target, draft_vocab=12, scale=0.3, fc_norm=True, norm_output=True)
    eng = Engine(target, drafter, mode=mode, tree=TreeShape(3, 3, 8), chain_k=3, adaptive=False,
                 confidence=confidence, ngram_tokens=ngram)  # fmt: skip
    out = eng.generate([Request(prompt, 3)] * N, params, batch_size=750)
    toks = torch.tensor([r.output_ids for r in out.results])
    assert toks.shape == (N, 3)
    assert out.stats.accepted > 0.02 * out.stats.drafts  # speculation really contributed tokens
    if ngram:
        assert out.stats.copied_tokens > 0  # copied candidates really were verified
    p1, m2, m3, j12 = _exact(hf, params, prompt)
    c = [torch.bincount(toks[:, i], minlength=V) for i in range(3)]
    pvals = [_chi2(c[0], p1), _chi2(c[1], m2), _chi2(c[2], m3),
             _chi2(torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V), j12)]  # fmt: skip
    assert min(pvals) > 1e-3, pvals
    # negative control: the same counts against a distorted distribution are rejected
    distorted = m2**1.5 / (m2**1.5).sum()
    assert _chi2(c[1], distorted) < 1e-3
    # and against the first-token distribution (what an engine ignoring context would produce)
    assert _chi2(c[1], p1) < 1e-3


def test_seeded_sampling_is_reproducible(model):
    target, _ = model
    drafter = random_drafter(target, draft_vocab=12)
    eng = Engine(target, drafter, mode="tree", adaptive=False)
    reqs = [Request(PROMPT, 6)] * 8
    a = [r.output_ids for r in eng.generate(reqs, SamplingParams(1.0, seed=5), batch_size=4).results]
    b = [r.output_ids for r in eng.generate(reqs, SamplingParams(1.0, seed=5), batch_size=4).results]
    assert a == b and len({tuple(x) for x in a}) > 1


def _hand_tree(b):
    # root -> a (1) -> c (3); root -> b (2)
    tokens = torch.tensor([[0, 4, 2, 5]]).expand(b, 4)
    parent = torch.tensor([[-1, 0, 0, 1]]).expand(b, 4)
    depth = torch.tensor([[0, 1, 1, 2]]).expand(b, 4)
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, 2))


def _accept_by_scores(tree, probs, generator):
    """The engine's sampled verification: Gumbel-max scores per position, then greedy acceptance."""
    n = probs.shape[0]
    batch = BatchSampling.of([SamplingParams(temperature=1.0)] * n, [None] * n, "cpu")
    scores = token_scores(probs.log(), batch, tree.depth + 1, generator)
    return accept_greedy(tree, scores, 2)


def test_scored_acceptance_marginals_on_hand_tree():
    n, v = 40000, 6
    p_root = torch.tensor([0.05, 0.1, 0.3, 0.05, 0.4, 0.1])  # drafts 4 (likely) and 2
    p_a = torch.tensor([0.2, 0.2, 0.1, 0.1, 0.1, 0.3])  # at node a; its draft child is 5
    p_b = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    p_c = torch.full((v,), 1 / v)
    probs = torch.stack([p_root, p_a, p_b, p_c])[None].expand(n, 4, v).contiguous()
    acc = _accept_by_scores(_hand_tree(n), probs, torch.Generator().manual_seed(0))
    tokens = _hand_tree(n).tokens
    path_tok = tokens.gather(1, acc.path)
    first = torch.where(acc.accepted >= 1, path_tok[:, 1], acc.next_token)
    assert _chi2(torch.bincount(first, minlength=v), p_root) > 1e-3
    assert _chi2(torch.bincount(first, minlength=v), torch.full((v,), 1 / v)) < 1e-6  # power
    # second token given the first is a=4 (through node a) follows p_a
    via_a = (acc.accepted >= 1) & (path_tok[:, 1] == 4)
    second = torch.where(acc.accepted >= 2, path_tok[:, 2], acc.next_token)[via_a]
    assert _chi2(torch.bincount(second, minlength=v), p_a) > 1e-3
    via_b = (acc.accepted == 1) & (path_tok[:, 1] == 2)
    assert _chi2(torch.bincount(acc.next_token[via_b], minlength=v), p_b) > 1e-3
    # acceptance happened on both branches and at depth 2, with the drafts' own probabilities
    assert via_b.sum() > 1000 and (acc.accepted == 2).sum() > 1000
    assert abs(float((acc.accepted >= 1).float().mean()) - 0.7) < 0.02  # p_root(4) + p_root(2)
    assert torch.all(acc.path[:, 0] == 0)
    assert torch.all((acc.accepted == 2) <= (acc.path[:, 1] == 1))


def test_scored_acceptance_never_takes_a_zero_prob_draft():
    n, v = 2000, 6
    p = torch.tensor([0.2, 0.2, 0.0, 0.2, 0.0, 0.4])  # drafts 4 and 2 are impossible
    probs = p[None, None].expand(n, 4, v).contiguous()
    acc = _accept_by_scores(_hand_tree(n), probs, torch.Generator().manual_seed(1))
    assert (acc.accepted == 0).all()
    assert not torch.isin(acc.next_token, torch.tensor([2, 4])).any()
    assert _chi2(torch.bincount(acc.next_token, minlength=v), p) > 1e-3
