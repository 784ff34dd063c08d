import json

import pytest
import torch

from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_target
from eaglespec.models.io import CheckpointError
from helpers import FAMILIES, hf_tiny, save_hf


def _prefill(model, ids, lens):
    b, t = ids.shape
    cache = model.new_cache(b)
    meta = cache.prepare(None, causal_mask(lens, t))
    h, aux = model(ids, meta.write_pos, cache, meta)
    cache.commit(None, lens)
    return cache, model.logits(h), aux


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tmp_path, family, tie):
    hf = hf_tiny(family, tie=tie)
    model = load_target(save_hf(hf, tmp_path / "m"))
    torch.manual_seed(3)
    lens = torch.tensor([11, 6, 9])
    ids = torch.randint(0, 96, (3, 11))
    assert model.aux_layers == (2, 2, 1)  # EAGLE-3 default (2, L//2, L-3) for L=4, in that order
    cache, logits, aux = _prefill(model, ids, lens)
    assert aux.shape[-1] == 3 * 64
    with torch.no_grad():
        for b in range(3):
            n = int(lens[b])
            ref = hf(ids[b : b + 1, :n], output_hidden_states=True)
            assert (logits[b, :n] - ref.logits[0]).abs().max() <= 1e-4
            hs = ref.hidden_states
            expect = torch.cat([hs[i] for i in model.aux_layers], -1)[0]  # HF index i = input of layer i
            assert (aux[b, :n] - expect).abs().max() <= 1e-4
        # decode three steps through the cache, compare with HF on the full sequence
        seqs = [ids[b, : int(lens[b])].tolist() for b in range(3)]
        for _ in range(3):
            nxt = torch.randint(0, 96, (3, 1))
            meta = cache.prepare(None, torch.ones(3, 1, 1, dtype=torch.bool))
            h, _ = model(nxt, meta.write_pos, cache, meta)
            cache.commit(None, torch.ones(3, dtype=torch.long))
            for b in range(3):
                seqs[b].append(int(nxt[b]))
                ref = hf(torch.tensor([seqs[b]])).logits[0, -1]
                assert (model.logits(h)[b, 0] - ref).abs().max() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_tiny("llama")
    hf.save_pretrained(str(tmp_path / "m"), max_shard_size="20KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    model = load_target(tmp_path / "m")
    ids = torch.randint(0, 96, (1, 7))
    _, logits, _ = _prefill(model, ids, torch.tensor([7]))
    with torch.no_grad():
        assert (logits[0] - hf(ids).logits[0]).abs().max() <= 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="llama, mistral, qwen2, qwen3"):
        load_target(d)


def test_bf16_and_fp16_load(tmp_path):
    d = save_hf(hf_tiny("qwen2"), tmp_path / "m")
    for dt, torch_dt in [("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        m = load_target(d, dtype=dt)
        assert next(m.parameters()).dtype == torch_dt
        _, logits, _ = _prefill(m, torch.randint(0, 96, (1, 5)), torch.tensor([5]))
        assert torch.isfinite(logits).all()


def test_aux_layers_six_layer_target(tmp_path):
    hf = hf_tiny("qwen3", layers=6)
    model = load_target(save_hf(hf, tmp_path / "m"))
    assert model.aux_layers == (2, 3, 3)
    ids = torch.randint(0, 96, (1, 8))
    _, _, aux = _prefill(model, ids, torch.tensor([8]))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    for j, i in enumerate((2, 3, 3)):
        assert (aux[0, :, j * 64 : (j + 1) * 64] - hs[i][0]).abs().max() <= 1e-4


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Window 8 < prompt length: prefill (no explicit positions) and decode must both apply it."""
    hf = hf_tiny("mistral", sliding_window=8)
    model = load_target(save_hf(hf, tmp_path / "m"))
    assert model.cfg.sliding_window == 8
    torch.manual_seed(5)
    lens = torch.tensor([21, 13])
    ids = torch.randint(0, 96, (2, 21))
    cache, logits, _ = _prefill(model, ids, lens)
    with torch.no_grad():
        for b in range(2):
            n = int(lens[b])
            assert (logits[b, :n] - hf(ids[b : b + 1, :n]).logits[0]).abs().max() <= 1e-4
        seqs = [ids[b, : int(lens[b])].tolist() for b in range(2)]
        for _ in range(3):
            nxt = torch.randint(0, 96, (2, 1))
            pos = cache.lengths[:2, None].clone()
            meta = cache.prepare(None, torch.ones(2, 1, 1, dtype=torch.bool), pos)
            h, _ = model(nxt, meta.write_pos, cache, meta)
            cache.commit(None, torch.ones(2, dtype=torch.long))
            for b in range(2):
                seqs[b].append(int(nxt[b]))
                assert (model.logits(h)[b, 0] - hf(torch.tensor([seqs[b]])).logits[0, -1]).abs().max() <= 1e-4
