"""The cost-aware speculation policy, its calibration cache and the precision choice."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from eaglespec.models.fast_linear import kernel_signature, prepare_for_inference
from eaglespec.models.precision import choose_dtype
from eaglespec.speculation import costs as costs_mod
from eaglespec.speculation.costs import StepCosts, cache_key, load_or_calibrate, tightened
from eaglespec.speculation.policy import AcceptanceModel, Policy, best_node_count, speculation_ceiling
from helpers import random_drafter, tiny_target


def _costs(a, b, c, draft=0.001, batch=1, grid=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)) -> StepCosts:
    """verify(n) = a + b n + c n^2 seconds (measured only at the grid points, as calibration does)."""
    return StepCosts(batch, {n: a + b * n + c * n * n for n in grid}, {k: draft * (1 + 0.1 * k) for k in (1, 2, 4, 8)})


def _value(q_sum, rows, seconds):
    return (rows + q_sum) / seconds


@pytest.mark.parametrize("seed", range(6))
def test_node_count_is_the_best_ancestor_closed_subset(seed):
    """Keeping the top-n nodes by q, for the best n, is as good as the best of *all* ancestor-closed
    node sets (brute force over every subset of a random 9-node tree)."""
    rng = random.Random(seed)
    n = 9
    parent = [-1] + [rng.randrange(0, i) if i > 1 else 0 for i in range(1, n + 1)]  # node 0 = root
    q = [1.0] + [0.0] * n
    for i in range(1, n + 1):  # q never grows along a path (a child is never likelier than its parent)
        q[i] = q[parent[i]] * rng.uniform(0.2, 0.95)
    costs = _costs(rng.uniform(2e-3, 5e-3), rng.uniform(1e-5, 4e-4), rng.uniform(0, 2e-5))
    draft = rng.uniform(5e-4, 3e-3)
    best = -1.0
    for mask in itertools.product([0, 1], repeat=n):
        chosen = {i + 1 for i, m in enumerate(mask) if m}
        if any(parent[i] != 0 and parent[i] not in chosen for i in chosen):
            continue  # not ancestor-closed: not a valid tree
        best = max(best, _value(sum(q[i] for i in chosen), 1, draft + costs.verify_cost(len(chosen) + 1)))
    q_sorted = torch.tensor(sorted(q[1:], reverse=True))[None]
    k, v = best_node_count(q_sorted, 1, draft, costs, max_nodes=64)
    assert v == pytest.approx(best, rel=1e-6)  # float32 sums
    brute = max(range(n + 1), key=lambda m: _value(float(q_sorted[0, :m].sum()), 1,
                                                  draft + costs.verify_cost(m + 1)))  # fmt: skip
    assert k == brute


def test_node_count_batches_share_one_count():
    costs = _costs(3e-3, 2e-4, 0)
    q = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.3, 0.2, 0.1, 0.0], [0.95, 0.9, 0.85, 0.8]])
    k, v = best_node_count(q, 3, 1e-3, costs, 64)
    values = [_value(float(q[:, :m].sum()), 3, 1e-3 + costs.verify_cost(m + 1)) for m in range(5)]
    assert k == max(range(5), key=values.__getitem__) and v == pytest.approx(max(values))


def _synthetic_step(policy: Policy, probs: list[list[float]], width: int) -> tuple[int, int, float]:
    """Drive the policy through the proposer's level loop on a synthetic drafter: probs[d][j] is the
    probability of a node's j-th child at depth d+1. Returns (levels drafted, nodes kept, value)."""
    f_score = torch.tensor([math.log(p) for p in probs[0][:width]])[None]
    scores, depths = [f_score], [torch.ones_like(f_score, dtype=torch.long)]
    levels, cond = 1, torch.tensor([math.log(p) for p in probs[0][:width]])
    for level in range(1, policy.max_depth):
        q = policy.acceptance.eagle_q(torch.cat(scores, 1), torch.cat(depths, 1))
        guess = (f_score[:, :, None] + cond[None, None]).reshape(1, -1)  # as the proposer guesses
        nxt = policy.acceptance.eagle_q(guess, torch.full(guess.shape, level + 1))
        if not policy.keep_drafting(level, q, nxt, policy.draft_seconds(level, width)):
            break
        child = torch.tensor([math.log(p) for p in probs[level][:width]])
        c = (f_score[:, :, None] + child[None, None]).reshape(1, -1)
        scores.append(c)
        depths.append(torch.full(c.shape, level + 1))
        f_score = c.topk(width, dim=-1).values
        levels, cond = levels + 1, child
    q = policy.acceptance.eagle_q(torch.cat(scores, 1), torch.cat(depths, 1))
    n = policy.node_count(q, policy.draft_seconds(levels, width))
    total = float(q.sort(descending=True).values[0, :n].sum())
    return levels, n, (1 + total) / (policy.draft_seconds(levels, width) + policy.costs.verify_cost(n + 1))


def _brute_force(policy: Policy, probs, width) -> float:
    best = 0.0
    for levels in range(1, policy.max_depth + 1):
        f_score = torch.tensor([math.log(p) for p in probs[0][:width]])[None]
        scores = [f_score]
        for level in range(1, levels):
            child = torch.tensor([math.log(p) for p in probs[level][:width]])
            c = (f_score[:, :, None] + child[None, None]).reshape(1, -1)
            scores.append(c)
            f_score = c.topk(width, dim=-1).values
        q_sorted = torch.cat(scores, 1).exp().sort(descending=True).values
        _, v = best_node_count(q_sorted, 1, policy.draft_seconds(levels, width), policy.costs, policy.max_nodes)
        best = max(best, v)
    return best


@pytest.mark.parametrize("conf", [0.9, 0.75, 0.5])
@pytest.mark.parametrize("cost_kind", ["cheap_verify", "linear", "steep"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_depth_and_nodes_near_brute_force(conf, cost_kind, width):
    """Stopping the drafting by the policy's confidence bound and then picking the node count reaches
    (within 3%) the best tokens/s over every depth and node count, for chains and trees."""
    costs = {"cheap_verify": _costs(4e-3, 2e-5, 0, draft=4e-4), "linear": _costs(4e-3, 3e-4, 0, draft=8e-4),
             "steep": _costs(4e-3, 5e-4, 3e-5, draft=1.5e-3)}[cost_kind]  # fmt: skip
    probs = [[conf * 0.97**d] + [(1 - conf) * 0.5**j for j in range(1, 8)] for d in range(8)]
    policy = Policy(costs, widths=(width,), max_depth=8, max_nodes=64)
    levels, n, value = _synthetic_step(policy, probs, width)
    best = _brute_force(policy, probs, width)
    assert value >= 0.97 * best, (levels, n, value, best)
    if cost_kind == "cheap_verify" and conf >= 0.75:
        assert levels >= 4 and n >= levels  # confident drafter, cheap checks: deep speculation


def test_nothing_pays_means_root_only_and_off():
    """Costs where speculation could pay, with a hopeless drafter: no node is worth verifying, and
    measured speculative steps slower than plain ones turn speculation off, then probe again."""
    costs = _costs(4e-3, 4e-4, 0, draft=3e-4)
    policy = Policy(costs, widths=(4,), max_depth=6)
    q = torch.full((1, 4), 0.05)
    assert policy.node_count(q, policy.draft_seconds(1, 4)) == 0
    assert not policy.keep_drafting(1, q, torch.full((1, 16), 0.01), policy.draft_seconds(1, 4))
    plain_rate = policy.plain_rate
    for _ in range(policy.judge_after):  # three speculative steps at half the plain rate
        assert policy.plan() is not None
        policy.observe(True, 1, 2.0 / plain_rate, (4, 1, 1))
    plans = [policy.plan() for _ in range(policy.backoff // 2)]
    assert plans == [None] * len(plans)  # plain steps for the back-off period
    for _ in range(10):
        if policy.plan() is not None:
            break
        policy.observe(False, 1, 1.0 / plain_rate)
    else:
        pytest.fail("the policy never probed speculation again")


def test_fixed_shape_policy_measures_plain_then_keeps_paying_speculation():
    policy = Policy(None, widths=(3,))
    assert policy.plain_rate is None
    seq = []
    for _ in range(8):
        plan = policy.plan()
        seq.append(plan is not None)
        policy.observe(plan is not None, 3 if plan else 1, 0.01)  # speculation: 300 tok/s, plain 100
    assert seq[:3] == [True] * 3 and seq[3:5] == [False, False] and all(seq[5:])
    forced = Policy(None, widths=(3,), adaptive=False)
    for _ in range(6):
        assert forced.plan() is not None
        forced.observe(True, 1, 1.0)


def test_acceptance_model_calibrates_confidence():
    m = AcceptanceModel(max_depth=4)
    for _ in range(200):  # the drafter says 0.8 at depth 1 but is right half the time
        m.observe_eagle([0, 0.8, 0], [0, 0.5, 0])
    q = m.eagle_q(torch.tensor([[math.log(0.8)]]), torch.tensor([[1]]))
    assert float(q) == pytest.approx(0.5, abs=0.02)
    for _ in range(200):
        m.observe_ngram([0, 10, 8, 0], [0, 6, 2, 0])
    assert m.ngram_q(2) == pytest.approx([0.6, 0.25], abs=0.03)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, _, _ = tiny_target(tmp_path_factory.mktemp("pol"), "llama")
    return target, random_drafter(target)


def test_calibration_cache_reused_keyed_and_rebuilt(pair, tmp_path, monkeypatch):
    target, drafter = pair
    path = tmp_path / "calibration.json"
    first = load_or_calibrate(target, drafter, 1, path=path)
    assert 1 in first.verify and max(first.verify) == 64 and set(first.draft) == {1, 2, 4, 8}
    calls = []
    real = costs_mod.calibrate
    monkeypatch.setattr(costs_mod, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert load_or_calibrate(target, drafter, 1, path=path).verify == first.verify and not calls  # cached
    load_or_calibrate(target, drafter, 2, path=path)  # another batch size: measured
    assert len(calls) == 1
    other, _, _ = tiny_target(tmp_path, "llama", layers=2)  # another model: another key
    assert cache_key(other, drafter, 1) != cache_key(target, drafter, 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # another thread count (the machine's speed): another key
        assert cache_key(target, drafter, 1) != cache_key(target, drafter, 2)
        key1 = cache_key(target, drafter, 1)
    finally:
        torch.set_num_threads(threads)
    assert key1 != cache_key(target, drafter, 1)
    unprepared = cache_key(target, drafter, 1)
    prepare_for_inference(target)  # the matmul kernels chosen for this machine: another key
    if kernel_signature(target):
        assert cache_key(target, drafter, 1) != unprepared
    path.write_text("{not json")  # corrupt file: ignored with a warning, rebuilt
    with pytest.warns(UserWarning, match="ignoring unreadable calibration cache"):
        load_or_calibrate(target, drafter, 1, path=path)
    assert cache_key(target, drafter, 1) in json.loads(path.read_text())
    raw = json.loads(path.read_text())
    raw[cache_key(target, drafter, 1)] = {"batch": 1, "verify": {"1": -1.0}, "draft": {}}  # corrupt entry
    path.write_text(json.dumps(raw))
    with pytest.warns(UserWarning, match="corrupt calibration entry"):
        fixed = load_or_calibrate(target, drafter, 1, path=path)
    assert min(fixed.verify.values()) > 0


def test_one_slow_measurement_cannot_make_plain_steps_look_dear():
    """This machine's cache once held a 16-row plain step at 251 ms beside 225 ms for 2 tokens a row and
    128 ms for 32 rows: the policy then saw speculation as nearly free in 9-16-row batches and drafted
    there, losing 3% of serving throughput. Tightened, no cost exceeds one at more tokens or more rows."""
    grid = (1, 2, 3, 4, 6, 8)
    measured = {
        16: StepCosts(16, {1: 0.251, 2: 0.225, 3: 0.230, 4: 0.240, 6: 0.300, 8: 0.380},
                      {1: 0.02, 2: 0.03, 4: 0.02, 8: 0.05}),
        32: StepCosts(32, {n: 0.128 * n for n in grid}, {1: 0.03, 2: 0.04, 4: 0.06, 8: 0.09}),
        64: StepCosts(64, {n: 0.25 * n for n in grid}, {1: 0.05, 2: 0.07, 4: 0.10, 8: 0.15}),
    }
    before = {b: (dict(c.verify), dict(c.draft)) for b, c in measured.items()}
    out = tightened(measured)
    assert {b: (c.verify, c.draft) for b, c in measured.items()} == before  # the measurements stay as they were
    assert out[16].verify[1] == 0.128 and out[16].verify[2] == 0.225  # bounded by 32 rows' step, by 2 tokens' step
    assert out[16].draft[1] == 0.02 and out[16].draft[2] == 0.02
    for b, c in out.items():
        for table in (c.verify, c.draft):
            values = [table[n] for n in sorted(table)]
            assert values == sorted(values)  # never cheaper with more tokens
        for n in c.verify:  # never cheaper with more rows
            assert all(c.verify[n] <= out[b2].verify[n] for b2 in out if b2 > b and n in out[b2].verify)
    assert out[32].verify == measured[32].verify and out[64].draft == measured[64].draft  # already consistent
    assert Policy(out[16]).plain_rate > Policy(measured[16]).plain_rate * 1.9


def test_policy_book_bounds_each_bucket_by_the_larger_ones(pair, tmp_path, monkeypatch):
    from eaglespec.speculation.config import SpecConfig
    from eaglespec.speculation.policies import PolicyBook

    target, drafter = pair
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path))
    costs = {b: load_or_calibrate(target, drafter, b) for b in (1, 2, 4)}
    raw = json.loads((tmp_path / "calibration.json").read_text())
    slow = costs[2].verify[1] * 50  # one slow moment while batch 2 was measured
    raw[cache_key(target, drafter, 2)]["verify"]["1"] = slow
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    book = PolicyBook(target, drafter, SpecConfig(mode="auto"))
    assert book.prepare(4) == [1, 2, 4]
    cost2 = book.for_batch(2).costs.verify[1]
    assert cost2 <= min(costs[2].verify[2], costs[4].verify[1]) < slow
    assert book.for_batch(1).costs.verify[1] <= cost2


def test_ceiling_follows_the_acceptance_a_bucket_measured():
    """Measured on SmolLM2 (calibrated costs of this machine's 16-row bucket): with the optimistic prior
    the ceiling lets the policy draft, and the drafter's nodes reach depth 1 in ~40% of rows there, where
    the ceiling is below 1.0. Once measured, the bucket stops drafting but for a rare probe; the same
    acceptance at batch 1's costs (memory-bound: more tokens a row nearly free) still pays."""
    from eaglespec.speculation import policy as policy_module
    from eaglespec.speculation.policy import OPTIMISTIC_ACCEPTANCE, REACH_PROBE_EVERY

    sixteen = StepCosts(16, {1: 0.0483, 2: 0.0667, 3: 0.088, 4: 0.1137, 6: 0.1674, 8: 0.2426},
                        {1: 0.0022, 2: 0.0031, 4: 0.0095, 8: 0.008})  # fmt: skip
    big, small = Policy(sixteen), Policy(_costs(0.024, 1e-4, 0, batch=1))
    assert big.acceptance is not small.acceptance  # each bucket measures the trees it verifies
    assert big.acceptance.reach(3) == pytest.approx([OPTIMISTIC_ACCEPTANCE**d for d in (1, 2, 3)])
    assert big.can_pay and small.can_pay
    for model in (big.acceptance, small.acceptance):
        for _ in range(10):  # 16 rows drafted to depth 2, 6 of them accepted depth 1 and 2 of those depth 2
            model.observe_reach([0.0, 16.0, 16.0], [0.0, 6.0, 2.0])
    reach = big.acceptance.reach(4)
    assert 0.37 < reach[0] < 0.45 and reach[1] < 0.2 and reach == sorted(reach, reverse=True)
    plans = [big.plan() for _ in range(2 * REACH_PROBE_EVERY)]
    assert sum(p is not None for p in plans) == 2 and plans[REACH_PROBE_EVERY - 1] is not None  # probes only
    assert big.plan() is None and big.backing_off
    assert small.can_pay and small.plan() is not None
    for _ in range(200):  # the text changed: drafts are right again
        big.acceptance.observe_reach([0.0, 16.0, 16.0], [0.0, 15.0, 14.0])
    assert big.can_pay
    assert policy_module.speculation_ceiling(sixteen, reach=[0.4**d for d in range(1, 9)]) < 1.0


def test_observed_steps_feed_reach_per_depth():
    """observe_acceptance counts, per depth, rows whose tree reached it and rows whose accepted path did."""
    from types import SimpleNamespace

    from eaglespec.speculation.policy import observe_acceptance

    model = AcceptanceModel(decay=1.0, prior=1e-9)
    # three rows; nodes: root, a (depth 1), a' (depth 1, less likely), b (depth 2, child of a)
    # row 0 accepts a and b, row 1 nothing, row 2 the second choice a'
    tree = SimpleNamespace(score=torch.tensor([[0.0, -0.1, -1.5, -0.5]] * 3), depth=torch.tensor([[0, 1, 1, 2]] * 3))
    acc = SimpleNamespace(path=torch.tensor([[0, 1, 3], [0, 0, 0], [0, 2, 2]]), accepted=torch.tensor([2, 0, 1]))
    observe_acceptance(model, tree, acc)
    assert model.reach(2) == pytest.approx([2 / 3, 1 / 3])


def test_suspect_calibration_is_noticed():
    costs = _costs(4e-3, 1e-4, 0)
    policy = Policy(costs, widths=(2,))
    for _ in range(20):
        policy.observe(False, 1, 20 * costs.verify_cost(1))  # 20x slower than calibrated
    assert policy.calibration_suspect()
    fresh = Policy(costs, widths=(2,))
    for _ in range(20):
        fresh.observe(False, 1, 1.1 * costs.verify_cost(1))
    assert not fresh.calibration_suspect()


def test_precision_choice_and_errors(monkeypatch):
    dims = {"hidden": 64, "intermediate": 128, "vocab": 96}
    with pytest.raises(ValueError, match="fp16 is not supported on CPU"):
        choose_dtype("cpu", "fp16", **dims)
    with pytest.raises(ValueError, match="must be one of"):
        choose_dtype("cpu", "int3", **dims)
    assert choose_dtype("cpu", "bf16", **dims) == ("bf16", "requested")
    from eaglespec import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "fma"})  # an AVX2-only EPYC
    dtype, why = choose_dtype("cpu", "auto", **dims)
    assert dtype == "fp32" and "no native bf16" in why
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    dtype, why = choose_dtype("cpu", "auto", **dims)
    assert dtype in ("fp32", "bf16") and "measured" in why


def test_unsupported_device_is_a_clear_error():
    from eaglespec.api import load_engine
    from eaglespec.settings import default_models_dir

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        load_engine(default_models_dir() / "target", None, device="cuda")


def test_only_steps_at_the_calibrated_batch_judge_the_calibration():
    costs = _costs(4e-3, 1e-4, 0)  # calibrated at batch 1
    policy = Policy(costs, widths=(2,))
    for _ in range(20):  # a bucket's smaller or larger batches run at other speeds: not evidence
        policy.observe(False, 3, 20 * costs.verify_cost(1), rows=3)
    assert not policy.calibration_suspect()
    for _ in range(20):
        policy.observe(False, 1, 20 * costs.verify_cost(1), rows=costs.batch)
    assert policy.calibration_suspect()


def test_no_drafting_where_the_costs_say_speculation_cannot_pay():
    """A compute-bound target (each verified token per row costs nearly a step, as at batch 64+ on a
    2-core CPU): even good drafts cannot gain 15%, so the policy plans plain steps from the start and
    reports backing off (the core then skips the drafter's prompt pairs); a memory-bound one speculates."""
    bound = _costs(1e-3, 9e-3, 0, draft=5e-4, batch=64)  # verify(2) / verify(1) = 1.9
    assert speculation_ceiling(bound) < 1.0
    policy = Policy(bound, widths=(1, 2, 4))
    assert [policy.plan() for _ in range(5)] == [None] * 5 and policy.backing_off
    policy.adaptive = False  # a forced shape still speculates
    assert policy.plan() is not None
    flat = _costs(20e-3, 1e-3, 0, draft=1e-3, batch=4)  # verify(2) / verify(1) = 1.05
    assert speculation_ceiling(flat) > 1.5
    policy = Policy(flat, widths=(1, 2, 4))
    assert policy.plan() is not None and not policy.backing_off
    long = _costs(1e-3, 9e-3, 0, draft=5e-4)  # what the ceiling reads follows the rows' context (set_context)
    long.long, long.long_context = {n: 0.2 + 9e-3 * n for n in (1, 2, 4, 8)}, 8192
    assert speculation_ceiling(long) < 1.0
    long.set_context(8000)
    assert speculation_ceiling(long) > 1.5


def test_backing_off_only_in_a_real_plain_run():
    costs = _costs(4e-3, 1e-4, 0)
    policy = Policy(costs, widths=(2,))
    assert not policy.backing_off
    policy.plain_left = 1  # a plain-rate probe
    assert not policy.backing_off
    policy.plain_left = policy.backoff
    assert policy.backing_off
    policy.adaptive = False
    assert not policy.backing_off


def test_auto_precision_falls_back_to_fp32_when_verification_rounds_unlike_plain(tmp_path, monkeypatch):
    from eaglespec.api import load_engine
    from eaglespec.models import precision

    target, _, path = tiny_target(tmp_path)
    assert precision.tree_plain_gap(target) <= precision.MAX_TREE_PLAIN_GAP  # fp32: same logits to ~1e-6
    monkeypatch.setattr(precision, "choose_dtype", lambda *a, **k: ("bf16", "faster in this test"))
    monkeypatch.setattr(precision, "tree_plain_gap", lambda t: 0.0)
    assert load_engine(path, dtype="auto").precision[0] == "bf16"
    monkeypatch.setattr(precision, "tree_plain_gap", lambda t: 0.06)
    dtype, why = load_engine(path, dtype="auto").precision
    assert dtype == "fp32" and "differ from plain steps by 0.06" in why
    assert next(load_engine(path, dtype="auto").target.parameters()).dtype == torch.float32
    dtype, why = load_engine(path, dtype="bf16").precision  # explicit: no check (the reason adds exactness)
    assert dtype == "bf16" and why.startswith("faster in this test;") and "not exact by construction" in why


def test_verification_cost_grows_with_context_and_trees_shrink():
    """Attention makes a verification of many tokens dearer with the context (measured on the bundled
    target at 5K positions: 17 tokens 2.7x a one-token step, 1.6x at 256): the costs follow the rows'
    context, and the policy verifies fewer nodes for long rows."""
    from eaglespec.speculation.costs import CALIBRATION_CONTEXT

    verify = {1: 2.5e-3, 4: 3.0e-3, 16: 4.6e-3, 32: 7.0e-3}
    long = {1: 4.5e-3, 4: 6.0e-3, 16: 11.0e-3}
    costs = StepCosts(1, verify, {1: 7e-4, 2: 8e-4, 4: 8e-4, 8: 9e-4}, long, 4096)
    assert StepCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert costs.verify_cost(16) == pytest.approx(4.6e-3)  # at the calibration context: the table
    q = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02]])
    short_n, _ = best_node_count(q, 1, 2e-3, costs, 32)
    costs.set_context(4096)
    assert costs.verify_cost(16) == pytest.approx(11.0e-3) and costs.verify_cost(1) == pytest.approx(4.5e-3)
    costs.set_context(8192)  # beyond the measured context: linear in the context
    slope = (11.0e-3 - 4.6e-3) / (4096 - CALIBRATION_CONTEXT)
    assert costs.verify_cost(16) == pytest.approx(4.6e-3 + slope * (8192 - CALIBRATION_CONTEXT))
    assert costs.verify_cost(32) > costs.verify_cost(16) > costs.verify_cost(4)  # past the long grid too
    long_n, _ = best_node_count(q, 1, 2e-3, costs, 32)
    assert long_n < short_n
    with pytest.raises(ValueError, match="long-context table"):
        StepCosts.from_json({**costs.to_json(), "long": {"3": 1e-3}})  # a point the short table lacks
