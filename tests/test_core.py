"""The step-level engine core: chunked prefill interleaved with decoding, KV-budget admission, abort."""

from __future__ import annotations

import pytest
import torch

from eaglespec.core import AdmissionError, EngineCore
from eaglespec.engine import Engine, Request
from eaglespec.spec.proposer import TreeShape
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
    core = EngineCore(engine, max_num_seqs=2, max_num_batched_tokens=16)
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
    slack = engine.tree_slack
    budget = 40 + 20 + slack  # one request of 40 prompt + 20 new tokens fits, two do not
    core = EngineCore(engine, max_num_seqs=4, kv_budget_tokens=budget)
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
    core = EngineCore(engine, max_num_seqs=2)
    ids = [core.add_request(r) for r in reqs]
    outputs, _ = _run(core, until=lambda o: ids[0] in o and ids[1] in o)
    assert core.abort(ids[0]) and not core.abort(ids[0]) and not core.abort(12345)
    assert core.abort(ids[2])  # still waiting: dropped from the queue
    assert sum(core.tcache.in_use) == 1
    outputs, _ = _run(core, outputs)
    assert outputs[ids[1]] == _alone(engine, reqs[1])
    assert not any(core.tcache.in_use)


def test_invalid_settings_are_clear_errors(engine):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineCore(engine, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineCore(engine, max_num_batched_tokens=-3)
    core = EngineCore(engine)
    with pytest.raises(ValueError, match="empty"):
        core.add_request(Request([], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        core.add_request(Request([1, 2], 0))
    assert not core.has_work
