"""The bundled 8.4M test model and its drafters (models/): they load, generate losslessly, and the drafters
really accept. SmolLM2, the default target, is tests/test_smollm2.py's."""

from __future__ import annotations

import json

import pytest

from eaglespec.api import generate, load_engine
from eaglespec.settings import default_models_dir
from eaglespec.speculation.config import TreeShape

MODELS = default_models_dir()
PROMPTS = [[{"role": "user", "content": "hi, how are you doing today?"}], "def read_config(path):\n"]


def _prompts(tok):
    out = []
    for p in PROMPTS:
        if isinstance(p, str):
            out.append(tok.encode(p, add_special_tokens=False))
        else:
            out.append(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
    return [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in out]


@pytest.fixture(scope="module")
def plain():
    engine = load_engine(MODELS / "target", None, mode="off")
    prompts = _prompts(engine.tokenizer)
    return prompts, [r.output_ids for r in generate(engine, prompts, max_new_tokens=40).results]


@pytest.mark.parametrize("name", ["drafter-eagle3.1", "drafter-eagle3"])
@pytest.mark.parametrize("mode", ["tree", "chain", "auto"])
def test_default_drafters_are_lossless_and_accept(plain, name, mode):
    prompts, expected = plain
    engine = load_engine(MODELS / "target", MODELS / name, mode=mode, tree=TreeShape(4, 4, 16), chain_k=4)
    engine.configure(adaptive=False)  # always speculate, so acceptance is measured on every step
    out = generate(engine, prompts, max_new_tokens=40)
    assert [r.output_ids for r in out.results] == expected
    assert out.stats.tau > 1.5, out.stats.tau  # trained drafters, not random ones (tau ~1.0)
    cfg = json.loads((MODELS / name / "config.json").read_text())
    assert bool(cfg.get("fc_norm")) == bool(cfg.get("norm_output")) == (name == "drafter-eagle3.1")
