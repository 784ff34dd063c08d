"""Long context: RoPE at far positions against transformers, long prompts stay lossless, the drafter's
attention window (masks against a naive reference, flat reads), KV growth, and the errors."""

import warnings

import pytest
import torch

from eaglespec.api import load_engine
from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import ContextLengthError, KVCache, causal_mask
from eaglespec.models.checkpoint import load_target, save_drafter
from eaglespec.models.drafter import set_attention_window
from eaglespec.models.drafter_config import DrafterConfig
from eaglespec.models.io import CheckpointError
from eaglespec.sampling import SamplingParams
from eaglespec.train.ttt import Batch, cropped_features, target_features
from helpers import hf_tiny, random_drafter, save_hf

FAR = 100_000


def _far_logits(model, ids, start):
    t = ids.shape[1]
    cache = model.new_cache(1)
    meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
    h, _ = model(ids, start + torch.arange(t)[None], cache, meta, capture_aux=False)
    return model.logits(h)


@pytest.mark.parametrize(
    "family,rope",
    [
        ("llama", {"rope_type": "default", "rope_theta": 500000.0}),
        ("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 65536}),
        ("qwen3", {"rope_type": "default", "rope_theta": 1000000.0}),
    ],
    ids=["llama-theta5e5", "llama-yarn4x", "qwen3-theta1e6"],
)  # fmt: skip
def test_logits_at_positions_above_100k_match_transformers(tmp_path, family, rope):
    hf = hf_tiny(family, layers=2, max_pos=262144, rope_parameters=rope)
    model = load_target(save_hf(hf, tmp_path / "m"))
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    for start in (FAR, 250_000):
        with torch.no_grad():
            ref = hf(ids, position_ids=start + torch.arange(12)[None]).logits
            ours = _far_logits(model, ids, start)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # and the positions matter: the same tokens near 0 give other logits (RoPE is not silently off)
    with torch.no_grad():
        near = _far_logits(model, ids, 0)
    assert (near - ours).abs().max() > 1e-3


def test_drafter_at_far_positions_depends_only_on_distances(tmp_path):
    """RoPE is relative: the drafter gives the same output for a sequence placed at 0 or past 100K, so it
    works at any position the target supports (no cliff at its max_position_embeddings)."""
    hf = hf_tiny("llama", layers=2)
    target = load_target(save_hf(hf, tmp_path / "m"))
    drafter = random_drafter(target)
    drafter.attach_target_embedding(target.model.embed_tokens)
    g = torch.Generator().manual_seed(0)
    ids, aux = torch.randint(0, 96, (1, 10), generator=g), torch.randn(1, 10, 3 * 64, generator=g)
    outs = []
    for start in (0, FAR + 7):
        cache = drafter.new_cache(1, 4096)
        meta = cache.prepare(None, causal_mask(torch.tensor([10]), 10))
        with torch.no_grad():
            logits, _ = drafter(ids, drafter.project(aux), start + torch.arange(10)[None], cache, meta)
        outs.append(logits)
    assert drafter.cfg.max_position_embeddings < FAR
    # fp32 angles at 1e5 carry ~1e-3 rad of rounding (transformers computes them the same way)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=0)


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    hf = hf_tiny("llama", layers=2, max_pos=32768, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    d = save_hf(hf, tmp_path_factory.mktemp("long") / "target")
    return hf, load_target(d), d


def test_greedy_lossless_with_a_16k_prompt(long_pair, monkeypatch):
    hf, target, _ = long_pair
    largest = []  # chunked prefill: no step builds a mask wider than one chunk by the context
    prepare = KVCache.prepare

    def spy(self, *args, **kwargs):
        meta = prepare(self, *args, **kwargs)
        largest.append(0 if meta.mask is None else meta.mask[0, 0].numel())
        return meta

    monkeypatch.setattr(KVCache, "prepare", spy)
    prompt = torch.randint(0, 96, (16_000,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    ref = ref[0, len(prompt) :].tolist()
    drafter = random_drafter(target)
    outs = {}
    for mode, window in (("tree", None), ("chain", None), ("tree", 64)):
        drafter.cfg.draft_attention_window = window
        engine = Engine(target, drafter, mode=mode, adaptive=False, draft_prefill_window=0 if window else None)
        out = engine.generate([Request(prompt, 12)], SamplingParams()).results[0]
        outs[(mode, window)] = out.output_ids
    assert all(v == ref for v in outs.values()), outs
    assert 512 * 15_000 <= max(largest) <= 512 * (16_000 + 12 + 64)


def _naive_window_mask(base, recent, new_mask, new_positions, window):
    """Visibility over every cache column 0..span-1, written out per (row, query, column)."""
    b, t, width = new_mask.shape
    span = int(base.max()) + t
    out = torch.zeros(b, t, span, dtype=torch.bool)
    for r in range(b):
        first_explicit = int(base[r]) - recent
        for q in range(t):
            for s in range(span):
                j = s - first_explicit
                seen = s < first_explicit or (0 <= j < width and bool(new_mask[r, q, j]))
                pos = s if s < int(base[r]) else int(new_positions[r, min(s - int(base[r]), t - 1)])
                out[r, q, s] = seen and int(new_positions[r, q]) - pos < window
    return out


@pytest.mark.parametrize("recent", [0, 3])
def test_window_mask_matches_a_naive_reference_and_reads_only_the_window(recent):
    g = torch.Generator().manual_seed(recent)
    window, t = 16, 5
    cache = KVCache(1, 3, 2, 8, max_length=4096, sliding_window=window)
    cache.lengths[:] = torch.tensor([70, 64, 90])
    base = cache.lengths.clone()
    new_mask = torch.rand(3, t, recent + t, generator=g) < 0.6
    new_mask[:, :, recent:] &= torch.ones(t, t, dtype=torch.bool).tril()
    new_mask[:, :, recent:] |= torch.eye(t, dtype=torch.bool)
    positions = base[:, None] - recent + torch.randint(0, 3, (3, t), generator=g).cumsum(1)
    meta = cache.prepare(None, new_mask, positions)
    full = _naive_window_mask(base, recent, new_mask, positions, window)
    assert meta.start > 0 and meta.mask.shape[-1] == full.shape[-1] - meta.start
    assert not full[:, :, : meta.start].any()
    assert torch.equal(meta.mask[:, 0], full[:, :, meta.start :])
    k, v = cache.write_and_read(0, meta, torch.randn(3, 2, t, 8), torch.randn(3, 2, t, 8))
    assert k.shape[2] == meta.span - meta.start  # reads stay near the window, not the whole context


def test_drafter_reads_stay_flat_as_the_context_grows(long_pair):
    """With a window, the drafter's attention reads the same number of columns at 300 and 3000 tokens."""
    _, target, _ = long_pair
    drafter = random_drafter(target)
    drafter.cfg.draft_attention_window = 128
    spans = []
    for n in (300, 3000):
        cache = drafter.new_cache(1, 8192)
        cache.lengths[0] = n
        meta = cache.prepare(None, torch.ones(1, 4, 4, dtype=torch.bool).tril(), n + torch.arange(4)[None])
        spans.append(meta.span - meta.start)
    assert spans[0] == spans[1] <= 128 + 4


def test_kv_cache_grows_with_the_need_not_the_model_context(long_pair):
    _, target, _ = long_pair
    cache = target.new_cache(1)
    assert cache.max_length == 32768 and cache.capacity <= 256
    for need in (300, 3000, 3100):
        cache.reserve(need)
        assert need <= cache.capacity <= 2 * need + 256, (need, cache.capacity)
    assert cache.k[0].shape[2] == cache.capacity < cache.max_length
    with pytest.raises(ContextLengthError, match="supports 32768"):
        cache.reserve(32769)


def test_target_features_in_chunks_and_the_cropped_view(long_pair, monkeypatch):
    import eaglespec.train.ttt as ttt

    _, target, _ = long_pair
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (2, 23), generator=g)
    ids[1, 17:] = 0
    batch = Batch(ids, torch.rand(2, 23, generator=g) < 0.5, torch.tensor([23, 17]))
    aux, logits = target_features(target, batch)
    monkeypatch.setattr(ttt, "TARGET_CHUNK", 5)
    aux5, logits5 = target_features(target, batch)
    torch.testing.assert_close(aux5[0], aux[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits5[1, :17], logits[1, :17], atol=1e-5, rtol=1e-5)
    crop, caux, clogits = cropped_features(target, batch, 8)
    assert crop.lengths.tolist() == [8, 8]
    for row, n in ((0, 23), (1, 17)):
        assert torch.equal(crop.input_ids[row], ids[row, n - 8 : n])
        assert torch.equal(crop.loss_mask[row], batch.loss_mask[row, n - 8 : n])
        torch.testing.assert_close(caux[row], aux[row, n - 8 : n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(clogits[row], logits[row, n - 8 : n], atol=1e-4, rtol=1e-4)


# -- bad input ----------------------------------------------------------------------------------------
def test_prompt_longer_than_the_context_is_refused_clearly(tmp_path):
    target = load_target(save_hf(hf_tiny("llama", layers=2, max_pos=2048), tmp_path / "m"))
    engine = Engine(target, random_drafter(target), mode="tree", adaptive=False)
    with pytest.raises(ContextLengthError, match="2048"):
        engine.generate([Request([1] * 2100, 16)], SamplingParams())
    # a prompt that fits but leaves less room than max_new_tokens stops at the context, as "length"
    out = engine.generate([Request([1] * 2040, 16)], SamplingParams()).results[0]
    assert out.finish_reason == "length" and len(out.prompt_ids) + len(out.output_ids) <= 2048


def test_window_settings_are_checked(long_pair, tmp_path):
    _, target, tdir = long_pair
    drafter = random_drafter(target)
    drafter.cfg.draft_attention_window = 256
    save_drafter(drafter, tmp_path / "d")
    with pytest.raises(ValueError, match="larger than the target's context of 32768"):
        load_engine(tdir, tmp_path / "d", mode="tree", dtype="fp32", draft_window=40_000)
    with pytest.warns(UserWarning, match="trained with draft_attention_window=256 but runs with no window"):
        engine = load_engine(tdir, tmp_path / "d", mode="tree", dtype="fp32", draft_window=0)
    assert engine.drafter.cfg.draft_attention_window is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = load_engine(tdir, tmp_path / "d", mode="tree", dtype="fp32", draft_window=128)
    assert engine.drafter.cfg.draft_attention_window == 128
    with pytest.raises(ValueError, match="integer >= 0"):
        set_attention_window(engine.drafter, -3, 32768)
    raw = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 96}
    with pytest.raises(CheckpointError, match="draft_attention_window must be a positive integer"):
        DrafterConfig.from_dict({**raw, "draft_attention_window": "wide"})
    assert DrafterConfig.from_dict({**raw, "draft_attention_window": 512}).to_dict()["draft_attention_window"] == 512


# -- slow: the real lengths ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_128k_prompt_end_to_end_with_a_tiny_model(tmp_path):
    hf = hf_tiny("llama", layers=2, hidden=32, heads=2, kv_heads=1, max_pos=140_000,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    target = load_target(save_hf(hf, tmp_path / "m"))
    prompt = torch.randint(0, 96, (131_072,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, -8:].tolist()
    for mode in ("off", "tree"):
        engine = Engine(target, random_drafter(target), mode=mode, adaptive=False)
        assert engine.generate([Request(prompt, 8)], SamplingParams()).results[0].output_ids == ref, mode


@pytest.mark.slow
def test_bundled_models_at_32k_stay_lossless():
    from eaglespec.settings import default_models_dir

    models = default_models_dir()
    engine = load_engine(models / "target", models / "drafter-eagle3.1", mode="tree", dtype="fp32", adaptive=False)
    text = (models / "target" / "README.md").read_text()
    ids = engine.tokenizer.encode(text * 200, add_special_tokens=False)[:32_000]
    spec = engine.generate([Request(ids, 24)], SamplingParams()).results[0]
    plain = Engine(engine.target, None, mode="off").generate([Request(ids, 24)], SamplingParams()).results[0]
    assert spec.output_ids == plain.output_ids
