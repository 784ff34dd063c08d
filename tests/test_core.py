"""The step-level engine core: chunked prefill interleaved with decoding, KV-budget admission, abort."""

from __future__ import annotations

import pytest
import torch

from eaglespec.batch_state import BatchState
from eaglespec.engine import Engine, Request
from eaglespec.scheduler import AdmissionError
from eaglespec.speculation.config import TreeShape
from helpers import random_drafter, tiny_target

LONG = 200


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target, _, _ = tiny_target(tmp_path_factory.mktemp("core"), max_pos=512)
    drafter = random_drafter(target)
    return Engine(target, drafter, mode="tree", tree=TreeShape(3, 2, 6), prefill_chunk=16, adaptive=False)


def _alone(engine, request) -> list[int]:
    return engine.generate([request]).results[0].output_ids


def _run(core, outputs=None, until=None, limit=2000):
    """Step until the core is idle (or until(outputs) holds); returns {id: output ids} and per-step gains."""
    outputs = {} if outputs is None else outputs
    gains = []
    for _ in range(limit):
        if not core.has_work or (until is not None and until(outputs)):
            break
        step = core.step()
        gains.append({o.request_id: len(o.new_token_ids) for o in step})
        for o in step:
            outputs[o.request_id] = o.output_ids
    return outputs, gains


def test_long_prompt_is_prefilled_in_chunks_between_decoding_steps(engine):
    g = torch.Generator().manual_seed(0)
    short = Request(torch.randint(0, 96, (5,), generator=g).tolist(), 60)
    long = Request(torch.randint(0, 96, (LONG,), generator=g).tolist(), 8)
    core = engine.new_core(max_num_seqs=2, max_num_batched_tokens=16)
    a = core.add_request(short)
    outputs, _ = _run(core, until=lambda o: a in o)  # the short request is decoding
    b = core.add_request(long)
    outputs, gains = _run(core, outputs, until=lambda o: b in o)
    # the long prompt took >= 200 / 16 chunks, and the short request gained tokens between them
    chunks = len(gains)
    assert chunks >= 2 * (LONG // 16) - 1
    assert sum(1 for g in gains if g.get(a, 0) > 0) >= LONG // 16 - 1
    outputs, _ = _run(core, outputs)
    assert outputs[a] == _alone(engine, short) and outputs[b] == _alone(engine, long)


def test_kv_budget_refuses_what_never_fits_and_queues_what_waits(engine):
    slack = engine.spec.tree_slack
    budget = 40 + 20 + slack  # one request of 40 prompt + 20 new tokens fits, two do not
    core = engine.new_core(max_num_seqs=4, kv_budget_tokens=budget)
    with pytest.raises(AdmissionError, match=f"KV budget is {budget}"):
        core.add_request(Request(list(range(50)), 20))
    assert not core.has_work  # nothing was queued
    reqs = [Request([(7 * i + j) % 96 for j in range(40)], 20) for i in range(2)]
    ids = [core.add_request(r) for r in reqs]
    core.step()
    assert core.num_running == 1 and core.num_waiting == 1  # the second waits for memory
    assert core.kv_usage() <= 1.0
    outputs, _ = _run(core)
    assert [outputs[i] for i in ids] == [_alone(engine, r) for r in reqs]


def test_abort_frees_the_slot_and_leaves_the_others_untouched(engine):
    reqs = [Request([(3 * i + j) % 96 for j in range(12)], 30) for i in range(3)]
    core = engine.new_core(max_num_seqs=2)
    ids = [core.add_request(r) for r in reqs]
    outputs, _ = _run(core, until=lambda o: ids[0] in o and ids[1] in o)
    assert core.abort(ids[0]) and not core.abort(ids[0]) and not core.abort(12345)
    assert core.abort(ids[2])  # still waiting: dropped from the queue
    assert sum(core.tcache.in_use) == 1
    outputs, _ = _run(core, outputs)
    assert outputs[ids[1]] == _alone(engine, reqs[1])
    assert not any(core.tcache.in_use)


def test_running_rows_stay_packed_in_slots_0_to_n_and_decode_as_alone(engine):
    """Rows of different lengths finish at different steps and queued ones take their place: before every
    step the running rows sit in slots 0..n-1 in batch order (the cache reads them as views, no gather),
    and each request still decodes exactly what it decodes alone."""
    reqs = [Request([(5 * i + j) % 96 for j in range(6 + 3 * i)], 4 + 7 * (i % 4)) for i in range(9)]
    core = engine.new_core(max_num_seqs=4, max_num_batched_tokens=8)
    ids = [core.add_request(r) for r in reqs]
    outputs, packed = {}, 0
    while core.has_work:
        for o in core.step():
            outputs[o.request_id] = o.output_ids
        core._run_deferred_extend()
        core._pack_slots()  # what the next step starts with
        slots = [r.slot for r in core.running]
        assert slots == list(range(len(slots))), slots
        live = {r.slot for r in core.running + core.scheduler.prefilling}
        assert [i for i, used in enumerate(core.tcache.in_use) if used] == sorted(live)
        packed += len(slots) > 1
    assert packed > 5
    assert [outputs[i] for i in ids] == [_alone(engine, r) for r in reqs]
    assert not any(core.tcache.in_use) and not any(core.dcache.in_use)


def test_invalid_settings_are_clear_errors(engine):
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.new_core(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.new_core(max_num_batched_tokens=-3)
    core = engine.new_core()
    with pytest.raises(ValueError, match="empty"):
        core.add_request(Request([], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        core.add_request(Request([1, 2], 0))
    assert not core.has_work


@pytest.mark.parametrize("window", [None, 7, 30])
def test_drafter_prefill_window_feeds_the_last_pairs_and_stays_lossless(engine, window):
    """With a window the drafter gets only the last `window` (state, token) pairs of each prompt, even
    when the window starts inside a prefill chunk and rows of different lengths share one; output
    stays the plain target's (only the proposals change)."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 23, 61]
    reqs = [Request(torch.randint(0, 96, (n,), generator=g).tolist(), 12) for n in lengths]
    plain = Engine(engine.target, prefill_chunk=16)
    expected = [_alone(plain, r) for r in reqs]
    old = engine.spec.draft_prefill_window
    engine.configure(draft_prefill_window=window or 0)
    try:
        core = engine.new_core(max_num_seqs=3, max_num_batched_tokens=48)
        ids = [core.add_request(r) for r in reqs]
        outputs, fed = {}, {}
        while core.has_work:
            before = {id(r) for r in core.running}
            for o in core.step():
                outputs[o.request_id] = o.output_ids
            core._run_deferred_extend()  # what the next step would run first
            for r in core.running:  # rows that just joined: the drafter holds only their prompt pairs
                if id(r) not in before:
                    fed[len(r.request.prompt_ids)] = int(core.dcache.lengths[r.slot])
        assert fed == {n: n - 1 if window is None else min(window, n - 1) for n in lengths}
        assert [outputs[i] for i in ids] == expected
    finally:
        engine.configure(draft_prefill_window=old)


def test_drafter_prefill_window_is_validated(engine):
    with pytest.raises(ValueError, match="draft_prefill_window"):
        Engine(engine.target, engine.drafter, mode="tree", draft_prefill_window=-1)
    assert Engine(engine.target, engine.drafter, mode="tree", draft_prefill_window=0).spec.prefill_window is None


def test_pending_drafter_pairs_keep_each_rows_latest_in_order():
    state = BatchState(torch.tensor([0, 0]), torch.tensor([[7, 0], [8, 9]]),
                       torch.tensor([[[7.0], [0.0]], [[8.0], [9.0]]]), torch.tensor([1, 2]))  # fmt: skip
    for tok in range(10, 14):
        state = state.with_pending(torch.tensor([tok, tok]), torch.tensor([[float(tok)], [float(tok)]]), keep=3)
    assert state.cnt.tolist() == [3, 3]
    assert state.ids.tolist() == [[11, 12, 13], [11, 12, 13]]
    assert state.aux[:, :, 0].tolist() == [[11.0, 12.0, 13.0], [11.0, 12.0, 13.0]]
    assert state.root.tolist() == [13, 13]
    short = BatchState(torch.tensor([5]), torch.tensor([[5]]), torch.zeros(1, 1, 1), torch.tensor([1]))
    short = short.with_pending(torch.tensor([6]), torch.ones(1, 1), keep=3)
    assert short.ids.tolist() == [[5, 6]] and short.cnt.tolist() == [2]


def test_generate_reuses_the_last_calls_caches_emptied(engine):
    g = torch.Generator().manual_seed(7)
    requests = [Request(torch.randint(0, 96, (n,), generator=g).tolist(), 12) for n in (9, 30)]
    engine.core = None  # a fresh start: the first call makes its caches
    first = [engine.generate([r]).results[0].output_ids for r in requests]
    caches = (engine.core.tcache, engine.core.dcache)
    again = [engine.generate([r]).results[0].output_ids for r in reversed(requests)][::-1]
    assert again == first  # nothing of the earlier requests leaks into the reused caches
    assert (engine.core.tcache, engine.core.dcache) == caches
    engine.generate(requests, batch_size=2)
    assert engine.core.tcache is not caches[0]  # another slot count: new caches
