"""The fast path stays lossless: packed/fused linears, the cost-aware policy (auto), confidence
truncation, policy switching mid-request and across batch sizes, at every precision it may choose."""

from __future__ import annotations

import pytest
import torch

from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_target
from eaglespec.models.fast_linear import PackedLinear, packing_available, prepare_for_inference
from eaglespec.speculation.config import TreeShape
from helpers import FAMILIES, hf_tiny, random_drafter, save_hf, tiny_target
from rigged import RiggedProposer
from test_greedy_lossless import _hf_greedy, _prompts

N_NEW = 20


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_policy_greedy_equals_plain_and_transformers(tmp_path, family):
    target, hf, _ = tiny_target(tmp_path, family)
    prompts = _prompts(4, seed=31)
    reqs = [Request(p, N_NEW) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    assert plain == [_hf_greedy(hf, p, N_NEW) for p in prompts]
    drafter = random_drafter(target, draft_vocab=64)
    for bs in (1, 3):
        eng = Engine(target, drafter, mode="auto", adaptive=False)
        eng.proposer = RiggedProposer(eng, plain, 96, break_every=3)  # long accepted paths, varied
        out = eng.generate(reqs, batch_size=bs)
        assert [r.output_ids for r in out.results] == plain, bs
        assert out.stats.drafts > 0 and out.stats.tau > 1.5
        eng = Engine(target, drafter, mode="auto", adaptive=False)  # the real proposer + policy
        out = eng.generate(reqs, batch_size=bs)
        assert [r.output_ids for r in out.results] == plain, bs


def test_bf16_speculation_equals_bf16_plain(tmp_path):
    """At the precision auto may pick on a CPU with native bf16, speculative output equals plain
    output at that precision (the packed kernels give each row the same bits for any row count)."""
    target, _, _ = tiny_target(tmp_path, "llama", dtype="bf16")
    prompts = _prompts(4, seed=32)
    reqs = [Request(p, N_NEW) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    drafter = random_drafter(target)
    for mode in ("auto", "tree", "chain"):
        eng = Engine(target, drafter, mode=mode, tree=TreeShape(4, 3, 10), adaptive=False)
        eng.proposer = RiggedProposer(eng, plain, 96, break_every=2) if mode != "auto" else eng.proposer
        out = eng.generate(reqs, batch_size=2)
        assert [r.output_ids for r in out.results] == plain, mode


def test_tree_rows_equal_single_token_steps(tmp_path):
    """The property lossless greedy rests on: the logits of a token verified inside a 9-node chain
    are what a plain one-token step computes at that position (fp32 and bf16)."""
    for dtype in ("fp32", "bf16"):
        target, _, _ = tiny_target(tmp_path, "llama", dtype=dtype)
        prepare_for_inference(target)
        down = target.model.layers[0].mlp.down_proj  # packed where oneDNN is row-invariant and faster here
        assert isinstance(down, PackedLinear) == packing_available(down.weight)
        ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            c1 = target.new_cache(1, max_length=64)
            meta = c1.prepare(None, causal_mask(torch.tensor([21]), 21))
            target(ids[:, :21], meta.write_pos, c1, meta, capture_aux=False)
            c1.commit(None, torch.tensor([21]))
            meta = c1.prepare(None, causal_mask(torch.tensor([9]), 9))
            h, _ = target(ids[:, 21:30], meta.write_pos, c1, meta, capture_aux=False)
            many = target.logits(h)[0]
            c2 = target.new_cache(1, max_length=64)
            meta = c2.prepare(None, causal_mask(torch.tensor([21]), 21))
            target(ids[:, :21], meta.write_pos, c2, meta, capture_aux=False)
            c2.commit(None, torch.tensor([21]))
            one = []
            for i in range(21, 30):
                meta = c2.prepare(None, torch.ones(1, 1, 1, dtype=torch.bool))
                h, _ = target(ids[:, i : i + 1], meta.write_pos, c2, meta, capture_aux=False)
                c2.commit(None, torch.tensor([1]))
                one.append(target.logits(h)[0, 0])
        one = torch.stack(one)
        assert (many.argmax(-1) == one.argmax(-1)).all(), dtype
        # linears are row-invariant (bitwise); attention over 9 queries sums in another order than over
        # one, so fp32 logits differ in the last bits (measured <= 1e-5): argmax agrees
        tol = 1e-4 if dtype == "fp32" else 5e-2
        assert torch.allclose(many.float(), one.float(), atol=tol, rtol=0), (dtype, (many - one).abs().max())


def test_policy_switching_mid_request_keeps_output(tmp_path, monkeypatch):
    """The policy turns speculation off and on inside a request, and each batch size gets its own
    policy: outputs never change."""
    import eaglespec.speculation.policy as policy_module

    monkeypatch.setattr(policy_module, "MIN_CEILING_GAIN", 0.0)  # the tiny model's costs would keep it off
    target, _, _ = tiny_target(tmp_path, "qwen2")
    reqs = [Request(p, 40) for p in _prompts(3, seed=33)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    eng = Engine(target, random_drafter(target), mode="auto", adaptive=True)
    for bs in (1, 2, 3, 1):
        out = eng.generate(reqs, batch_size=bs)
        assert [r.output_ids for r in out.results] == plain, bs
    policy = eng.policies._by_batch[1]
    policy.judge_after, policy.backoff = 1, 2
    policy.plain_rate = 1e9  # plain "measures" infinitely fast: speculation must switch off ...
    flips = []
    orig_observe = policy.observe

    def observe(speculated, tokens, seconds, shape=None, rows=None):
        flips.append(speculated)
        orig_observe(speculated, tokens, seconds, shape, rows)
        if not speculated:
            policy.plain_rate = 1e-9  # ... and back on after the first plain step
        elif len(flips) % 3 == 0:
            policy.plain_rate = 1e9

    policy.observe = observe
    out = eng.generate(reqs, batch_size=1)
    assert [r.output_ids for r in out.results] == plain
    assert True in flips and False in flips and sum(a != b for a, b in zip(flips, flips[1:])) >= 4
    assert set(eng.policies._by_batch) == {1, 2, 3}


def test_server_start_prepares_every_batch_bucket_and_rescales_a_stale_calibration_once(tmp_path, monkeypatch):
    target, _, _ = tiny_target(tmp_path, "llama")
    eng = Engine(target, random_drafter(target), mode="auto")
    assert eng.prepare_policies(5) == [1, 2, 4, 5]
    policies = eng.policies._by_batch
    assert set(policies) == {1, 2, 4, 5} and all(p.costs.batch == b for b, p in policies.items())
    import eaglespec.speculation.policies as engine_module

    monkeypatch.setattr(engine_module, "load_or_calibrate", lambda *a, **k: pytest.fail("measured inside a step"))
    policy = eng.policies._by_batch[2]
    calibrated = policy.costs.verify_cost(1), policy.costs.draft_cost(2)
    for _ in range(2):  # persistently 20x off: rescaled the first time only, nothing measured again
        for _ in range(20):
            policy.observe(False, 2, 20 * policy.costs.verify_cost(1), rows=2)
        assert eng.policies.for_batch(2) is policy
    assert policy.costs.verify_cost(1) == pytest.approx(20 * calibrated[0])
    assert policy.costs.draft_cost(2) == pytest.approx(20 * calibrated[1])


def test_confidence_truncation_is_lossless_and_drafts_less(tmp_path):
    target, _, _ = tiny_target(tmp_path, "llama")
    reqs = [Request(p, 30) for p in _prompts(4, seed=34)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    drafter = random_drafter(target, scale=0.5)
    full = Engine(target, drafter, mode="tree", tree=TreeShape(5, 3, 12), adaptive=False).generate(reqs)
    cut = Engine(target, drafter, mode="tree", tree=TreeShape(5, 3, 12), adaptive=False, confidence=0.3)
    out = cut.generate(reqs, batch_size=2)
    assert [r.output_ids for r in out.results] == plain == [r.output_ids for r in full.results]
    assert out.stats.draft_tokens < full.stats.draft_tokens
    with pytest.raises(ValueError, match="confidence"):
        Engine(target, drafter, confidence=1.5)


def test_packed_model_state_dict_and_tie_unchanged(tmp_path):
    hf = hf_tiny("llama", tie=True)
    d = save_hf(hf, tmp_path / "tied")
    target = load_target(d)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    prepare_for_inference(target)
    prepare_for_inference(target)  # idempotent
    after = target.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_hybrid_copied_candidates_are_lossless_and_accepted(tmp_path):
    """Context n-grams merged into the drafter's tree: output equals plain decoding (greedy), and on
    text that repeats itself (the plain output appended to the prompt) copied tokens get accepted."""
    target, hf, _ = tiny_target(tmp_path, "llama")
    base = _prompts(3, seed=35)
    first = [r.output_ids for r in Engine(target).generate([Request(p, 30) for p in base]).results]
    prompts = [p + o + p for p, o in zip(base, first)]  # the continuation of p appeared once already
    reqs = [Request(p, 30) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    assert plain[0] == _hf_greedy(hf, prompts[0], 30)
    drafter = random_drafter(target)
    for mode, ngram, bs in [("tree", 6, 1), ("chain", 8, 2), ("auto", None, 1), ("auto", None, 3)]:
        eng = Engine(target, drafter, mode=mode, tree=TreeShape(3, 2, 6), chain_k=3, adaptive=False,
                     ngram_tokens=ngram)  # fmt: skip
        out = eng.generate(reqs, batch_size=bs)
        assert [r.output_ids for r in out.results] == plain, (mode, bs)
        s = out.stats
        if mode != "auto":  # auto copies only where the measured costs say it pays (timing-dependent)
            assert s.copied_tokens > 0 and s.copied_accepted > 0, (mode, s.copied_tokens)
    with pytest.raises(ValueError, match="ngram_tokens"):
        Engine(target, drafter, ngram_tokens=99)
