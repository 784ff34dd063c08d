import pytest

from eaglespec.engine import Engine, Request
from eaglespec.speculation.config import TreeShape
from eaglespec.stats import SpecStats, aggregate
from helpers import random_drafter, tiny_target
from rigged import RiggedProposer


def test_tau_and_per_position_hand_fed():
    s = SpecStats()
    for n, a in [(4, 2), (4, 0), (4, 4), (4, 1)]:
        s.observe_draft(n, a)
    assert s.drafts == 4 and s.draft_tokens == 16 and s.accepted == 7
    assert s.tau == pytest.approx(1 + 7 / 4)
    assert s.acceptance_rate == pytest.approx(7 / 16)
    # vLLM: position i counts drafts with >= i+1 accepted tokens
    assert s.accepted_per_pos == [3, 2, 1, 1]
    assert s.per_position_acceptance == pytest.approx([0.75, 0.5, 0.25, 0.25])
    assert sum(s.accepted_per_pos) == s.accepted
    d = s.to_dict()
    assert d["tau"] == pytest.approx(2.75) and d["accepted_tokens"] == 7


def test_empty_stats_and_merge():
    e = SpecStats()
    assert e.tau == 1.0 and e.acceptance_rate == 0.0 and e.per_position_acceptance == []
    a, b = SpecStats(), SpecStats()
    a.observe_draft(3, 3)
    b.observe_draft(3, 1)
    b.observe_draft(3, 0)
    m = aggregate([a, b])
    assert m.drafts == 3 and m.accepted == 4 and m.accepted_per_pos == [2, 1, 1]
    assert m.tau == pytest.approx(1 + 4 / 3)


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_engine_stats_consistent(tmp_path, mode):
    target, _, _ = tiny_target(tmp_path, "llama")
    reqs = [Request([3, 1, 4, 1, 5][: i + 2], 20) for i in range(4)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    eng = Engine(target, random_drafter(target), mode=mode, tree=TreeShape(4, 3, 10), chain_k=4, adaptive=False)
    eng.proposer = RiggedProposer(eng, plain, 96)
    out = eng.generate(reqs, batch_size=2)
    assert [r.output_ids for r in out.results] == plain
    for r in out.results:
        s = r.stats
        assert s.new_tokens == len(r.output_ids) == 20
        assert sum(s.accepted_per_pos) == s.accepted
        assert s.target_forwards / s.new_tokens < 1
        assert s.drafts > 0 and s.tau > 4 * 0.7 + 1
        # every position's count is monotonically non-increasing
        assert all(x >= y for x, y in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))
        # tokens: 1 from prefill + per step (accepted + 1), capped at max_new_tokens
        assert s.accepted + s.drafts + 1 >= s.new_tokens
    tot = out.stats
    assert tot.accepted == sum(r.stats.accepted for r in out.results)
    assert tot.new_tokens == 80 and tot.drafts == sum(r.stats.drafts for r in out.results)
    assert tot.draft_tokens == tot.drafts * (10 if mode == "tree" else 4)


def test_plain_engine_has_no_drafts(tmp_path):
    target, _, _ = tiny_target(tmp_path, "llama")
    out = Engine(target).generate([Request([1, 2, 3], 5)])
    s = out.results[0].stats
    assert s.drafts == 0 and s.tau == 1.0 and s.new_tokens == 5 and s.target_forwards == 5
