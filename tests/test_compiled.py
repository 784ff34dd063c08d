"""Compiled forwards (models/compiled.py): lossless against eager plain decoding on every path, eager
fallback when compiling fails, and the measured auto choice (cache, corrupt cache, short jobs)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from eaglespec.api import choose_compile
from eaglespec.engine import Engine, Request
from eaglespec.models import compiled
from eaglespec.models.precision import tree_plain_gap
from eaglespec.sampling import SamplingParams
from helpers import random_drafter, tiny_target
from rigged import RiggedProposer
from test_greedy_lossless import _prompts

N_NEW = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, _, _ = tiny_target(tmp_path_factory.mktemp("compiled"))
    drafter = random_drafter(target, draft_vocab=64)
    prompts = _prompts(3, seed=5)
    reqs = [Request(p, N_NEW) for p in prompts]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]  # eager reference
    yield target, drafter, reqs, plain
    compiled.uncompile(target)
    compiled.uncompile(drafter)


def test_compiled_greedy_equals_eager_plain(pair):
    """Default run (compiling costs about a minute on 2 cores): compiled plain decoding and compiled
    speculation (the policy's auto mode, and a rigged chain with long accepted paths) equal eager plain."""
    target, drafter, reqs, plain = pair
    use, why = choose_compile(Engine(target, drafter, mode="auto"), "on")
    assert use and compiled.is_compiled(target) and compiled.is_compiled(drafter), why
    assert [r.output_ids for r in Engine(target).generate(reqs).results] == plain
    assert [r.output_ids for r in Engine(target, drafter, mode="auto").generate(reqs).results] == plain
    eng = Engine(target, drafter, mode="chain", chain_k=3, adaptive=False)
    eng.proposer = RiggedProposer(eng, plain, 96, break_every=3)
    out = eng.generate(reqs)
    assert [r.output_ids for r in out.results] == plain and out.stats.tau > 1.5


@pytest.mark.slow
def test_compiled_paths_equal_eager_plain(pair):
    """Greedy output of compiled plain, tree, chain and auto decoding (batch 1 and 2, real and rigged
    proposers, so long accepted paths and compaction run) equals eager plain decoding; sampling with a
    seed gives the same tokens compiled and eager."""
    target, drafter, reqs, plain = pair
    compiled.uncompile(target)
    compiled.uncompile(drafter)
    sampled = Engine(target, drafter, mode="chain", chain_k=3, adaptive=False).generate(
        reqs, SamplingParams(temperature=0.8, seed=3))
    engine = Engine(target, drafter, mode="auto")
    use, why = choose_compile(engine, "on")
    assert use and compiled.is_compiled(target) and compiled.is_compiled(drafter), why
    assert [r.output_ids for r in Engine(target).generate(reqs).results] == plain
    for mode, kw in (("tree", {}), ("chain", {"chain_k": 3}), ("auto", {})):
        for bs in (1, 2):
            eng = Engine(target, drafter, mode=mode, adaptive=False, **kw)
            assert [r.output_ids for r in eng.generate(reqs, batch_size=bs).results] == plain, (mode, bs)
            eng.proposer = RiggedProposer(eng, plain, 96, break_every=3)
            out = eng.generate(reqs, batch_size=bs)
            assert [r.output_ids for r in out.results] == plain, (mode, bs, "rigged")
            assert out.stats.tau > 1.5
    again = Engine(target, drafter, mode="chain", chain_k=3, adaptive=False).generate(
        reqs, SamplingParams(temperature=0.8, seed=3))
    assert [r.output_ids for r in again.results] == [r.output_ids for r in sampled.results]


@pytest.fixture
def w8a8_onednn(monkeypatch):
    """W8A8 layers whose eager kernel is oneDNN's where it is exact here (CPUs with VNNI or AMX): its
    packed weight is opaque to inductor, so compiled graphs need their own kernels (models/int8_kernels.py)."""
    from eaglespec.models import int8_kernels, quantize

    real = int8_kernels.fastest_int8_kernels
    onednn = "onednn" in int8_kernels.exact_int8_kernels()

    def eager_onednn(shape):
        return ("onednn", "onednn") if onednn else real(shape)

    monkeypatch.setattr(int8_kernels, "fastest_int8_kernels", eager_onednn)
    return quantize


def test_compiled_w8a8_target_is_lossless(tmp_path, w8a8_onednn, pair):
    """Default run (one compiled model, ~1-2 minutes on 2 cores): a compiled W8A8 target's verification
    rows equal its plain steps bit for bit, its plain decoding equals eager, and speculation with long
    accepted paths equals it. An unquantized model of the same class is compiled and run first in this
    process (dynamo checking its graphs' guards on the quantized model made compiling fail)."""
    fp32_target, _, fp32_reqs, fp32_plain = pair
    compiled.compile_model(fp32_target)
    assert [r.output_ids for r in Engine(fp32_target).generate(fp32_reqs[:1]).results] == fp32_plain[:1]
    target, _, _ = tiny_target(tmp_path)
    w8a8_onednn.apply_quantize(target, "w8a8")
    reqs = [Request(p, N_NEW) for p in _prompts(2, seed=6)]
    eager = [r.output_ids for r in Engine(target).generate(reqs).results]
    drafter = random_drafter(target, draft_vocab=64)
    try:
        compiled.compile_model(target)
        assert tree_plain_gap(target) == 0.0
        assert [r.output_ids for r in Engine(target).generate(reqs).results] == eager
        eng = Engine(target, drafter, mode="chain", chain_k=3, adaptive=False)
        eng.proposer = RiggedProposer(eng, eager, 96, break_every=3)
        out = eng.generate(reqs, batch_size=2)
        assert [r.output_ids for r in out.results] == eager and out.stats.tau > 1.5
    finally:
        compiled.uncompile(target)


@pytest.mark.slow
def test_compile_on_w8a8_engine_every_path(tmp_path, w8a8_onednn):
    """`--compile on` for a W8A8 target and its drafter (compiling failed before with oneDNN kernels):
    compiled auto and chain speculation at batch 1 and 2 equal compiled plain decoding."""
    target, _, _ = tiny_target(tmp_path)
    w8a8_onednn.apply_quantize(target, "w8a8")
    drafter = random_drafter(target, draft_vocab=64)
    reqs = [Request(p, N_NEW) for p in _prompts(3, seed=6)]
    try:
        use, why = choose_compile(Engine(target, drafter, mode="auto"), "on")
        assert use and compiled.is_compiled(target) and compiled.is_compiled(drafter), why
        plain = [r.output_ids for r in Engine(target).generate(reqs).results]
        for mode in ("chain", "auto"):
            for bs in (1, 2):
                eng = Engine(target, drafter, mode=mode, chain_k=3, adaptive=False)
                assert [r.output_ids for r in eng.generate(reqs, batch_size=bs).results] == plain, (mode, bs)
    finally:
        compiled.uncompile(target)
        compiled.uncompile(drafter)


def test_compile_failure_falls_back_to_eager(tmp_path, monkeypatch):
    target, _, _ = tiny_target(tmp_path)
    drafter = random_drafter(target, draft_vocab=64)
    reqs = [Request(p, 8) for p in _prompts(2, seed=9)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]

    def broken(fn, **_kw):
        def run(*a, **k):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    engine = Engine(target, drafter, mode="tree", adaptive=False)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        use, why = choose_compile(engine, "on")
    assert not use and "inductor exploded" in why
    assert not compiled.is_compiled(target) and not compiled.is_compiled(drafter)
    assert [r.output_ids for r in engine.generate(reqs).results] == plain
    # auto remembers the failure for this machine and models, and does not try again
    key_engine = Engine(target, drafter, mode="auto")
    with pytest.warns(UserWarning):
        assert choose_compile(key_engine, "auto")[0] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use, why = choose_compile(key_engine, "auto")
    assert not use and "failed here before" in why


def test_decide_from_measurement():
    v = {"eager_step_s": 0.003, "compiled_step_s": 0.0015, "compile_s": 30.0}
    assert compiled.decide(v, None)[0]  # a server: compiling pays over its lifetime
    assert compiled.decide(v, 100_000)[0]  # 100K tokens x 1.5 ms = 150 s > 30 s
    use, why = compiled.decide(v, 1_000)  # 1.5 s saved < 30 s compiling
    assert not use and "would not pay" in why
    use, why = compiled.decide({**v, "compiled_step_s": 0.0029}, None)
    assert not use and "not faster" in why


def test_auto_short_job_stays_eager_and_corrupt_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "compile.json").write_text("{not json")
    assert compiled.read_verdicts() == {}
    target, _, _ = tiny_target(tmp_path)
    engine = Engine(target, None, mode="off")
    use, why = choose_compile(engine, "auto", expected_tokens=64)  # nothing measured yet: no compiling
    assert not use and "not measured" in why and not compiled.is_compiled(target)
    with pytest.raises(ValueError, match="--compile must be one of"):
        choose_compile(engine, "always")
    compiled.write_verdict("k", {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 2.0})
    assert json.loads((tmp_path / "cache" / "compile.json").read_text())["k"]["compile_s"] == 2.0
