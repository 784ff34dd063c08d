"""llama.cpp bench peer. The oracle is llama.cpp itself (code we did not write): its greedy output on the
converted target must equal our engine's plain greedy output. Those tests need scripts/llamacpp/build.sh and
are skipped without it (CI never builds llama.cpp); the refusal / not-built tests always run."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglespec.bench.methods import parse_kinds
from eaglespec.bench.peers import llamacpp
from eaglespec.export.llamacpp_convert import UnsupportedDrafter, check_drafter_supported, is_gpt2_byte_level

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET, EAGLE3, EAGLE31 = MODELS / "target", MODELS / "drafter-eagle3", MODELS / "drafter-eagle3.1"
NOT_BUILT = llamacpp.not_built_reason()
needs_build = pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")


def test_eagle31_drafter_is_refused_with_reason():
    with pytest.raises(UnsupportedDrafter, match="no fc_norm mapping"):
        check_drafter_supported(EAGLE31)
    check_drafter_supported(EAGLE3)  # plain EAGLE-3 passes


def test_not_built_is_reported_and_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLESPEC_LLAMACPP", str(tmp_path))
    reason = llamacpp.not_built_reason()
    assert reason is not None and "scripts/llamacpp/build.sh" in reason
    assert llamacpp.llamacpp_methods(["llamacpp_plain", "llamacpp_eagle3"], TARGET, [], (5,), threads=1) == []
    assert "scripts/llamacpp/build.sh" in capsys.readouterr().err


def test_missing_converter_module_is_reported(tmp_path, monkeypatch):
    for rel in (f"build/bin/{llamacpp.SERVER}", "src/convert_hf_to_gguf.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(llamacpp, "CONVERTER_MODULES", ("yaml", "no_such_module_for_the_test"))
    reason = llamacpp.not_built_reason(tmp_path)
    assert reason is not None and "pip install no_such_module_for_the_test" in reason and "yaml" not in reason


def test_methods_are_opt_in():
    assert parse_kinds("plain,llamacpp_plain,llamacpp_eagle3") == ["plain", "llamacpp_plain", "llamacpp_eagle3"]
    assert not any(k.startswith("llamacpp") for k in parse_kinds(None) + parse_kinds("all"))


def test_metrics_and_outputs_are_parsed():
    m = llamacpp.parse_metrics('# HELP x\nllamacpp:n_decode_total 7\n'
                               'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2\n'
                               'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5\n')  # fmt: skip
    assert m["n_decode_total"] == 7 and llamacpp.accepted_per_position(m) == [5, 2]
    assert llamacpp.cut_at_stop([7, 0, 5, 9], (5,)) == [7, 0, 5]  # our convention: keep the stop id, drop the rest
    clock = llamacpp.clock_summary([{"decode_tokens": 10, "decode_ms": 20.0, "draft_tokens": 8, "accepted": 2}])
    assert clock["decode_tokens_per_s"] == 500.0 and clock["acceptance_rate"] == 0.25


def test_bundled_tokenizer_is_plain_gpt2_byte_level():
    assert is_gpt2_byte_level(TARGET)  # the condition for mapping its unknown checksum to llama.cpp's "gpt-2"


GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def bundled():
    """Our engine's plain greedy outputs on one chat and one code prompt, with the stop ids and tokenizer."""
    from eaglespec.api import load_tokenizer, stop_ids_for
    from eaglespec.engine import Engine, Request
    from eaglespec.models.checkpoint import load_target
    from eaglespec.sampling import SamplingParams
    from eaglespec.suites import load_prompts

    tok = load_tokenizer(TARGET)
    engine = Engine(load_target(TARGET), None, mode="off", tokenizer=tok)
    by_cat, _ = load_prompts(["chat", "code"], tok, limit=1, max_new_tokens=GREEDY_TOKENS, max_length=4096)
    prompts = [p.ids for items in by_cat.values() for p in items]
    stop_ids = stop_ids_for(engine)
    out = engine.generate([Request(p, GREEDY_TOKENS, stop_ids) for p in prompts], SamplingParams(0.0, 1.0, 0, 0))
    return tok, stop_ids, prompts, [r.output_ids for r in out.results]


def threads() -> int:
    import torch

    return torch.get_num_threads()


def tokenize(method, text: str) -> list[int]:
    body = {"content": text, "add_special": False, "parse_special": True}
    return llamacpp.json.loads(llamacpp.http(method.server.url + "/tokenize", body))["tokens"]


@needs_build
def test_llamacpp_plain_matches_our_greedy(bundled):
    from eaglespec.sampling import SamplingParams

    tok, stop_ids, prompts, ours = bundled
    (method,) = llamacpp.llamacpp_methods(["llamacpp_plain"], TARGET, [], stop_ids, threads=threads())
    try:
        # the prompt goes in as ids; still, llama.cpp's tokenizer ("gpt-2" pre-tokenizer) must agree with ours
        assert tokenize(method, tok.decode(prompts[0])) == prompts[0]
        run = method.run(prompts, GREEDY_TOKENS, SamplingParams(0.0, 1.0, 0, 0), 1)
    finally:
        method.server.stop()
    assert run.outputs == ours
    assert method.timings[0]["decode_tokens_per_s"] > 0


@needs_build
def test_llamacpp_eagle3_matches_our_greedy_and_counts_drafts(bundled):
    from eaglespec.sampling import SamplingParams

    _, stop_ids, prompts, ours = bundled
    drafters = [("EAGLE-3.1", EAGLE31), ("EAGLE-3", EAGLE3)]  # 3.1 is skipped with a message
    (method,) = llamacpp.llamacpp_methods(["llamacpp_eagle3"], TARGET, drafters, stop_ids, threads=threads())
    try:
        run = method.run(prompts, GREEDY_TOKENS, SamplingParams(0.0, 1.0, 0, 0), 1)
    finally:
        method.server.stop()
    assert run.outputs == ours
    assert run.stats.drafts > 0 and run.stats.draft_tokens >= run.stats.accepted


@needs_build
def test_llamacpp_int4_peer_runs_llama_quantize_q4_0(bundled):
    """--quantize int4's peer: llama.cpp's q4_0 of the same target, written by its own llama-quantize."""
    from eaglespec.sampling import SamplingParams

    _, stop_ids, prompts, _ = bundled
    (method,) = llamacpp.llamacpp_methods(["llamacpp_plain"], TARGET, [], stop_ids, threads=threads(),
                                          quantize="int4")  # fmt: skip
    try:
        run = method.run(prompts[:1], 8, SamplingParams(0.0, 1.0, 0, 0), 1)
    finally:
        method.server.stop()
    assert method.settings["outtype"] == "q4_0" and "no: q4_0" in method.settings["lossless_check"]
    assert len(run.outputs[0]) > 0
    gguf = Path(method.settings["gguf"])
    f32 = gguf.with_name(gguf.name.replace("-q4_0.gguf", ".gguf"))
    assert gguf.stat().st_size < 0.4 * f32.stat().st_size  # 4.5 bits per weight in the layers, vs 32
