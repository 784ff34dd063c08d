"""The CUDA path (run by scripts/gpu/check.sh; skipped without a CUDA GPU): speculative greedy output
equals the target's own plain greedy output on the GPU, at the precision `--dtype auto` picks there and
with quantized targets, and `transformers` on the same weights is the oracle for plain fp32 decoding."""

from __future__ import annotations

import pytest
import torch

from eaglespec.api import generate, load_engine
from eaglespec.settings import default_models_dir
from eaglespec.speculation.config import TreeShape

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu/check.sh)")]

MODELS = default_models_dir()
PROMPTS = ["The history of the city", "def read_config(path):\n", "Once upon a time there was"]


def _ids(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8"])
@pytest.mark.parametrize("mode", ["tree", "chain", "auto"])
def test_speculation_equals_plain_on_cuda(mode, quantize):
    kw = {"device": "cuda", "dtype": "auto", "quantize": quantize}
    plain = load_engine(MODELS / "target", None, mode="off", **kw)
    spec = load_engine(MODELS / "target", MODELS / "drafter-eagle3.1", mode=mode, tree=TreeShape(4, 4, 16),
                       chain_k=4, **kw)  # fmt: skip
    spec.configure(adaptive=False)
    prompts = _ids(plain)
    want = [r.output_ids for r in generate(plain, prompts, max_new_tokens=48).results]
    got = generate(spec, prompts, max_new_tokens=48)
    assert [r.output_ids for r in got.results] == want, (plain.precision, mode, quantize)
    assert got.stats.tau > 1.2  # the drafter is used, on the GPU


def test_plain_fp32_on_cuda_equals_transformers():
    from transformers import AutoModelForCausalLM

    engine = load_engine(MODELS / "target", None, device="cuda", dtype="fp32", mode="off")
    ref = AutoModelForCausalLM.from_pretrained(str(MODELS / "target"), dtype=torch.float32).cuda().eval()
    for ids in _ids(engine):
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False,
                               eos_token_id=engine.tokenizer.eos_token_id)  # fmt: skip
        want = out[0, len(ids) :].tolist()
        got = generate(engine, [ids], max_new_tokens=24).results[0].output_ids
        assert got == want[: len(got)] and got


def test_batched_speculation_on_cuda_equals_batch_one():
    engine = load_engine(MODELS / "target", MODELS / "drafter-eagle3.1", device="cuda", mode="tree")
    prompts = _ids(engine) * 4
    together = [r.output_ids for r in generate(engine, prompts, max_new_tokens=32).results]
    alone = [generate(engine, [p], max_new_tokens=32).results[0].output_ids for p in prompts[:3]]
    assert together[:3] == alone and together[3:6] == alone
