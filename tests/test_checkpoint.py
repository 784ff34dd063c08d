import json

import pytest
import torch
from safetensors.torch import save_file

from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_drafter, load_target, save_drafter
from eaglespec.models.drafter import Eagle3Drafter
from eaglespec.models.drafter_config import new_drafter_config
from eaglespec.models.io import CheckpointError
from eaglespec.speculation.config import TreeShape
from helpers import random_drafter, tiny_target

H, V = 64, 96


@pytest.fixture(scope="module")
def tgt(tmp_path_factory):
    target, hf, d = tiny_target(tmp_path_factory.mktemp("t"), "llama")
    return target


@pytest.fixture(scope="module")
def plain(tgt):
    reqs = [Request([5, 17, 33, 2, 9], 16), Request([44, 1], 16), Request(list(range(20, 40)), 16)]
    return reqs, [r.output_ids for r in Engine(tgt).generate(reqs).results]


def _run_drafter(d, target, dtype):
    """One drafter forward over 5 positions on fixed inputs; returns (logits, state)."""
    d.attach_target_embedding(target.model.embed_tokens)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 5, 3 * H, generator=g).to(dtype)
    ids = torch.randint(0, V, (1, 5), generator=g)
    cache = d.new_cache(1, 64)
    meta = cache.prepare(None, causal_mask(torch.tensor([5]), 5))
    return d(ids, d.project(aux), meta.write_pos, cache, meta)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("flags", [(True, True), (False, False)])
def test_round_trip_bit_identical(tmp_path, tgt, dtype, name, flags):
    d = random_drafter(tgt, fc_norm=flags[0], norm_output=flags[1], draft_vocab=40).to(dtype)
    save_drafter(d, tmp_path / "d", dtype=name)
    back = load_drafter(tmp_path / "d", target=tgt, dtype=name)
    sd0, sd1 = d.state_dict(), back.state_dict()
    assert set(sd0) == set(sd1)
    for k in sd0:
        assert sd0[k].dtype == sd1[k].dtype and torch.equal(sd0[k], sd1[k]), k
    l0, s0 = _run_drafter(d, tgt, dtype)
    l1, s1 = _run_drafter(back, tgt, dtype)
    assert torch.equal(l0, l1) and torch.equal(s0, s1)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == V
    for f, on in zip(("fc_norm", "norm_output"), flags):
        assert (cfg.get(f) is True) if on else (f not in cfg)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("t2d").sum() == 40
    assert "midlayer.self_attn.q_proj.weight" in keys and "fc.weight" in keys and "lm_head.weight" in keys
    assert not any(k.startswith("model.") or k.startswith("layers.") for k in keys)
    assert ("fc_norm.0.weight" in keys) == flags[0]
    assert "embed_tokens.weight" not in keys


def _reference_tensors(seed=0, draft_vocab=V, embed=False, prefix="midlayer."):
    """Reference §1.2 layout written by hand (H=64, 4 heads of 16, 2 kv heads, I=128)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.2).to(torch.bfloat16)
    one = lambda n: torch.ones(n, dtype=torch.bfloat16)
    t = {
        "fc.weight": r(H, 3 * H),
        "norm.weight": one(H),
        "lm_head.weight": r(draft_vocab, H),
        f"{prefix}input_layernorm.weight": one(H),
        f"{prefix}hidden_norm.weight": one(H),
        f"{prefix}post_attention_layernorm.weight": one(H),
        f"{prefix}self_attn.q_proj.weight": r(64, 2 * H),
        f"{prefix}self_attn.k_proj.weight": r(32, 2 * H),
        f"{prefix}self_attn.v_proj.weight": r(32, 2 * H),
        f"{prefix}self_attn.o_proj.weight": r(H, 64),
        f"{prefix}mlp.gate_proj.weight": r(128, H),
        f"{prefix}mlp.up_proj.weight": r(128, H),
        f"{prefix}mlp.down_proj.weight": r(H, 128),
    }
    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    if embed:
        t["embed_tokens.weight"] = r(V, H)
    return t


def _reference_config(draft_vocab=V, **kw):
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "vocab_size": V,
        "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, **kw,
    }  # fmt: skip


def _write(path, tensors, cfg):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    if cfg is not None:
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("variant", ["midlayer", "layers0", "embed", "small_vocab"])
def test_hand_written_reference_drafter_runs(tmp_path, tgt, plain, variant):
    dv = 48 if variant == "small_vocab" else V
    t = _reference_tensors(draft_vocab=dv, embed=variant == "embed",
                           prefix="layers.0." if variant == "layers0" else "midlayer.")  # fmt: skip
    p = _write(tmp_path / variant, t, _reference_config(draft_vocab=dv))
    d = load_drafter(p, target=tgt)
    assert d.cfg.eagle_version == "EAGLE-3" and not hasattr(d, "fc_norm")
    assert (d.embed_tokens is not None) == (variant == "embed")
    assert torch.equal(d.midlayer.mlp.down_proj.weight, t[("layers.0." if variant == "layers0" else "midlayer.")
                                                          + "mlp.down_proj.weight"].float())  # fmt: skip
    assert torch.equal(d.draft_to_target, torch.arange(dv) + t["d2t"])
    reqs, ref = plain
    for mode in ("tree", "chain"):
        out = Engine(tgt, d, mode=mode, tree=TreeShape(3, 3, 8), chain_k=3, adaptive=False).generate(reqs, batch_size=2)
        assert [r.output_ids for r in out.results] == ref
        assert out.stats.drafts > 0


def _bad(tmp_path, name, mutate_t=None, mutate_c=None):
    t, c = _reference_tensors(), _reference_config()
    if mutate_t:
        mutate_t(t)
    if mutate_c:
        mutate_c(c)
    return _write(tmp_path / name, t, c)


def _set(d, k, v):
    d[k] = v


@pytest.mark.parametrize(
    "name,mt,mc,msg",
    [
        ("missing", lambda t: t.pop("midlayer.mlp.up_proj.weight"), None, "missing tensors ['midlayer.mlp.up_proj"),
        ("extra", lambda t: _set(t, "midlayer.bogus.weight", torch.ones(3)), None, "unexpected tensors"),
        ("shape", lambda t: _set(t, "fc.weight", torch.ones(H, 2 * H)), None, "fc.weight: file (64, 128)"),
        ("fcnorm", lambda t: _set(t, "fc_norm.0.weight", torch.ones(H)), None, "does not set fc_norm"),
        ("d2t_range", lambda t: _set(t, "d2t", t["d2t"] + 5), None, "outside the target vocabulary"),
        ("cfg_key", None, lambda c: c.pop("intermediate_size"), "lacks required keys ['intermediate_size']"),
        ("layers2", None, lambda c: _set(c, "num_hidden_layers", 2), "num_hidden_layers=2"),
    ],
)
def test_validation_errors(tmp_path, name, mt, mc, msg):
    p = _bad(tmp_path, name, mt, mc)
    with pytest.raises(CheckpointError) as e:
        load_drafter(p)
    assert msg in str(e.value)


def test_pair_mismatches(tmp_path, tgt):
    t = _reference_tensors(draft_vocab=80)
    t["d2t"] = torch.zeros(80, dtype=torch.long)
    t["t2d"] = torch.ones(80, dtype=torch.bool)
    p = _write(tmp_path / "vocab2", t, _reference_config(draft_vocab=80, vocab_size=80))
    with pytest.raises(CheckpointError, match="vocab_size 80 != target vocab_size 96"):
        load_drafter(p, target=tgt)
    t = _reference_tensors()
    t["fc.weight"] = torch.ones(H, 3 * 32, dtype=torch.bfloat16)
    p = _write(tmp_path / "ht", t, _reference_config(target_hidden_size=32))
    with pytest.raises(CheckpointError, match="target hidden size 32 but the target has 64"):
        load_drafter(p, target=tgt)
    # and the engine checks a pair too
    d = random_drafter(tgt)
    d.cfg.vocab_size = 80
    with pytest.raises(CheckpointError, match="vocab_size"):
        Engine(tgt, d)


def test_file_level_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    p = _write(tmp_path / "nocfg", _reference_tensors(), None)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(p)
    p = _write(tmp_path / "trunc", _reference_tensors(), _reference_config())
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_drafter(p)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(_reference_config()))
    with pytest.raises(CheckpointError, match="has no weights"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_target(tmp_path / "badjson")


def test_eagle3_semantics_flags_off(tgt):
    """fc_norm off: no fc_norm params and fc sees raw aux; norm_output off: state is the pre-norm x."""
    e3 = random_drafter(tgt, fc_norm=False, norm_output=False)
    e31 = random_drafter(tgt, fc_norm=True, norm_output=True)
    assert not any("fc_norm" in k for k in e3.state_dict())
    assert sum("fc_norm" in k for k in e31.state_dict()) == 3
    aux = torch.randn(2, 3 * H) * 5
    assert torch.allclose(e3.project(aux), aux @ e3.fc.weight.T, atol=1e-5)
    # 3.1: each chunk RMS-normalised before fc (weights all ones after init)
    chunks = [c / c.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() for c in aux.chunk(3, -1)]
    assert torch.allclose(e31.project(aux), torch.cat(chunks, -1) @ e31.fc.weight.T, atol=1e-4)
    for d in (e3, e31):
        logits, state = _run_drafter(d, tgt, torch.float32)
        n = d.norm(state)
        assert torch.allclose(d.lm_head(n if not d.cfg.norm_output else state), logits, atol=1e-5)
        if d.cfg.norm_output:
            assert torch.allclose(d.norm(state), state, atol=1e-4) or torch.allclose(
                state.pow(2).mean(-1), torch.ones(1), atol=1e-3)
        else:
            assert not torch.allclose(n, state, atol=1e-2)  # pre-norm: norm changes it
    # same weights, only the flag differs: logits of one step agree, states differ by the norm
    e3b = Eagle3Drafter(new_drafter_config(tgt.cfg, fc_norm=False, norm_output=True))
    e3b.load_state_dict(e3.state_dict(), strict=False)
    l_a, s_a = _run_drafter(e3, tgt, torch.float32)
    l_b, s_b = _run_drafter(e3b, tgt, torch.float32)
    assert torch.allclose(l_a, l_b, atol=1e-5) and torch.allclose(e3.norm(s_a), s_b, atol=1e-5)


def test_eagle_version_names_the_ablations(tgt):
    """Only both switches make EAGLE-3.1; one switch alone is labelled as the ablation it is (drift, export)."""
    names = [random_drafter(tgt, fc_norm=f, norm_output=n).cfg.eagle_version
             for f, n in ((True, True), (False, False), (True, False), (False, True))]  # fmt: skip
    assert names == ["EAGLE-3.1", "EAGLE-3", "EAGLE-3 + fc_norm", "EAGLE-3 + norm_output"]
