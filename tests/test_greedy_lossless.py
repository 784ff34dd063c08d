import pytest
import torch

from eaglespec.engine import Engine, Request
from eaglespec.speculation.config import TreeShape
from helpers import FAMILIES, random_drafter, tiny_target
from rigged import RiggedProposer

N_NEW = 24


def _prompts(n, seed, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_greedy_equals_plain_and_transformers(tmp_path, family):
    target, hf, _ = tiny_target(tmp_path, family)
    prompts = _prompts(5, seed=hash(family) % 1000)
    reqs = [Request(p, N_NEW) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    assert plain == [_hf_greedy(hf, p, N_NEW) for p in prompts]
    for flags in [(False, False), (True, True)]:
        drafter = random_drafter(target, fc_norm=flags[0], norm_output=flags[1], draft_vocab=64 if flags[0] else None)
        for mode, bs in [("tree", 1), ("chain", 1), ("tree", 3), ("chain", 4)]:
            eng = Engine(target, drafter, mode=mode, tree=TreeShape(3, 3, 8), chain_k=3, adaptive=False)
            out = eng.generate(reqs, batch_size=bs)
            assert [r.output_ids for r in out.results] == plain, (flags, mode, bs)
            assert out.stats.drafts > 0


@pytest.mark.parametrize("mode,shape", [("tree", TreeShape(5, 3, 12)), ("chain", None)])
@pytest.mark.parametrize("batch", [1, 3])
def test_rigged_long_paths_exercise_compaction(tmp_path, mode, shape, batch):
    target, hf, _ = tiny_target(tmp_path, "llama")
    prompts = _prompts(6, seed=7)
    reqs = [Request(p, 40) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    drafter = random_drafter(target)
    eng = Engine(target, drafter, mode=mode, tree=shape, chain_k=5, adaptive=False)
    eng.proposer = RiggedProposer(eng, plain, 96, break_every=3)
    out = eng.generate(reqs, batch_size=batch)
    assert [r.output_ids for r in out.results] == plain
    s = out.stats
    assert s.tau > 3.0, s.tau  # long accepted paths really happened
    assert 0 < s.accepted_per_pos[-1] < s.drafts  # and so did partial ones
    assert sum(s.accepted_per_pos) == s.accepted
    assert s.target_forwards < s.new_tokens
    for r in out.results:
        assert r.stats.new_tokens == len(r.output_ids) == 40


def test_stops_on_eos_like_plain(tmp_path):
    target, hf, _ = tiny_target(tmp_path, "qwen2")
    prompts = _prompts(4, seed=11)
    free = [r.output_ids for r in Engine(target).generate([Request(p, 30) for p in prompts]).results]
    eos = free[0][5]  # a token the first row emits: it must stop right there
    reqs = [Request(p, 30, stop_token_ids=(eos,)) for p in prompts]
    plain = Engine(target).generate(reqs).results
    assert plain[0].output_ids[-1] == eos and plain[0].finish_reason == "stop"
    assert len(plain[0].output_ids) <= 6
    drafter = random_drafter(target)
    eng = Engine(target, drafter, mode="chain", chain_k=4, adaptive=False)
    eng.proposer = RiggedProposer(eng, free, 96)
    spec = eng.generate(reqs, batch_size=2).results
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]


def test_adaptive_governor_keeps_output(tmp_path):
    target, _, _ = tiny_target(tmp_path, "llama")
    reqs = [Request(p, 30) for p in _prompts(3, seed=5)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    eng = Engine(target, random_drafter(target), mode="tree", adaptive=True)
    for _ in range(2):
        assert [r.output_ids for r in eng.generate(reqs).results] == plain


@pytest.mark.parametrize("mode,shape", [("tree", TreeShape(4, 3, 10)), ("chain", None)])
def test_rigged_perfect_drafts_high_tau(tmp_path, mode, shape):
    target, hf, _ = tiny_target(tmp_path, "mistral")
    prompts = _prompts(4, seed=13)
    reqs = [Request(p, 30) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    assert plain[0] == _hf_greedy(hf, prompts[0], 30)
    drafter = random_drafter(target, fc_norm=False, norm_output=False, draft_vocab=50)
    eng = Engine(target, drafter, mode=mode, tree=shape, chain_k=4, adaptive=False)
    eng.proposer = RiggedProposer(eng, plain, 96)
    out = eng.generate(reqs, batch_size=3)
    assert [r.output_ids for r in out.results] == plain
    s = out.stats
    assert s.tau > 4 * 0.7 + 1, s.tau
    # the true branch is always there, so every full draft is accepted at every position
    # (only the last step of a row may be cut short by max_new_tokens, which is counted in full)
    pos = s.per_position_acceptance
    assert len(pos) == 4 and all(p > 0.95 for p in pos), pos
    assert s.target_forwards < 0.35 * s.new_tokens


def test_sliding_window_greedy_equals_transformers(tmp_path):
    target, hf, _ = tiny_target(tmp_path, "mistral", sliding_window=8)
    prompts = _prompts(3, seed=21)
    reqs = [Request(p, 14) for p in prompts]
    ref = [_hf_greedy(hf, p, 14) for p in prompts]
    assert [r.output_ids for r in Engine(target).generate(reqs).results] == ref
    eng = Engine(target, random_drafter(target), mode="tree", tree=TreeShape(3, 3, 8), adaptive=False)
    eng.proposer = RiggedProposer(eng, ref, 96)  # long accepted paths cross the window edge
    out = eng.generate(reqs, batch_size=2)
    assert [r.output_ids for r in out.results] == ref and out.stats.tau > 2
