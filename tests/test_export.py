"""Interop: `eaglespec export` (eagle3, speculators, gguf), every import layout, and the external checks.

Oracles we did not write: the `gguf` package's reader, llama.cpp's own convert_hf_to_gguf.py and
llama-server (skipped unless scripts/llamacpp/build.sh ran), and speculators' own loader and forward in
its own environment (skipped unless scripts/interop/build_envs.sh ran). CI runs the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglespec.cli import main
from eaglespec.export import export_drafter, open_source
from eaglespec.export.gguf import permute_rope_rows
from eaglespec.models.checkpoint import load_drafter, load_target, save_drafter
from eaglespec.models.io import CheckpointError, load_tensors
from helpers import hf_tiny, random_drafter, save_hf

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET, EAGLE3, EAGLE31 = MODELS / "target", MODELS / "drafter-eagle3", MODELS / "drafter-eagle3.1"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama target (8 layers) and an EAGLE-3.1 drafter with a reduced vocabulary and
    norm_before_residual, saved in dialect A as bf16."""
    root = tmp_path_factory.mktemp("pair")
    target_dir = save_hf(hf_tiny("llama", layers=8, vocab=96), root / "target")
    target = load_target(target_dir)
    drafter = random_drafter(target, draft_vocab=64)
    drafter.cfg.norm_before_residual = True
    save_drafter(drafter, root / "drafter", dtype="bf16")
    return Path(target_dir), root / "drafter", target


def draft_logits(drafter_dir, target, seed=0):
    """Two TTT steps of the drafter on fixed random target states: its whole forward, as numbers."""
    from eaglespec.train.ttt import ttt_forward

    d = load_drafter(drafter_dir, target=target)
    if d.embed_tokens is None:
        d.attach_target_embedding(target.model.embed_tokens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 12), generator=g)
    aux = torch.randn(1, 12, 3 * target.cfg.hidden_size, generator=g)
    with torch.no_grad():
        return torch.stack(ttt_forward(d, aux, ids, 2))


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# -- eagle3 (dialect A) ---------------------------------------------------------------------------
def test_eagle3_export_writes_every_optional_key_explicitly(pair, tmp_path):
    target_dir, drafter_dir, target = pair
    export_drafter(drafter_dir, "eagle3", tmp_path / "e3", target_dir=target_dir)
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    ids = [2, 4, 5]  # capture-before ids 2, L//2, L-3; a first id of 1 would make SGLang shift the set
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    expected = {"fc_norm": True, "norm_output": True, "norm_before_fc": False, "norm_before_residual": True,
                "bias": False, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                "draft_vocab_size": 64, "target_hidden_size": 64, "num_aux_hidden_states": 3,
                "torch_dtype": "bfloat16", "rope_theta": 10000.0}  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    # the export is the same model, bit for bit
    assert same_tensors(load_tensors(drafter_dir), load_tensors(tmp_path / "e3"))
    assert torch.equal(draft_logits(drafter_dir, target), draft_logits(tmp_path / "e3", target))


def test_export_casts_only_when_asked(pair, tmp_path):
    target_dir, drafter_dir, target = pair
    export_drafter(drafter_dir, "eagle3", tmp_path / "fp32", target_dir=target_dir, dtype="fp32")
    t = load_tensors(tmp_path / "fp32")
    assert t["fc.weight"].dtype == torch.float32 and t["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"
    assert torch.equal(t["fc.weight"].bfloat16(), load_tensors(drafter_dir)["fc.weight"])  # bf16 -> fp32 is exact


# -- speculators ----------------------------------------------------------------------------------
def test_speculators_export_layout(pair, tmp_path):
    target_dir, drafter_dir, target = pair
    export_drafter(drafter_dir, "speculators", tmp_path / "s", target_dir=target_dir, verifier="org/tiny-target",
                   speculative_tokens=5)  # fmt: skip
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    # every flag explicit: vLLM turns a missing norm_before_residual into true
    assert {k: cfg[k] for k in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")} == {
        "fc_norm": True, "norm_output": True, "norm_before_fc": False, "norm_before_residual": True}  # fmt: skip
    layer = cfg["transformer_layer_config"]
    assert layer["head_dim"] == target.cfg.head_dim and layer["num_hidden_layers"] == 1
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    tensors = load_tensors(tmp_path / "s")
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    embed = load_tensors(target_dir)["model.embed_tokens.weight"]
    assert torch.equal(tensors["embed_tokens.weight"], embed)  # an exact copy of the target's, in its dtype


def test_round_trip_eagle3_speculators_eagle3_is_bit_exact(pair, tmp_path):
    target_dir, drafter_dir, target = pair
    export_drafter(drafter_dir, "speculators", tmp_path / "s", target_dir=target_dir)
    export_drafter(tmp_path / "s", "eagle3", tmp_path / "back", target_dir=target_dir)
    # the embedding copy is dropped again (it equals the target's), so the tensors are the original ones
    assert same_tensors(load_tensors(drafter_dir), load_tensors(tmp_path / "back"))
    src = open_source(tmp_path / "s", target_dir)
    assert src.cfg.norm_before_residual and src.cfg.fc_norm and src.cfg.draft_vocab_size == 64
    want = draft_logits(drafter_dir, target)
    assert torch.equal(want, draft_logits(tmp_path / "s", target))
    assert torch.equal(want, draft_logits(tmp_path / "back", target))


def test_narrow_drafter_with_own_embedding_round_trips(pair, tmp_path):
    """target_hidden_size != hidden_size: fc reads 3 x the target's width, the drafter ships its own embedding."""
    from eaglespec.export import engine_ignored_keys
    from eaglespec.models.drafter import Eagle3Drafter
    from eaglespec.models.drafter_config import DrafterConfig

    target_dir, _, target = pair
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=96, draft_vocab_size=96, target_hidden_size=64, fc_norm=True)  # fmt: skip
    torch.manual_seed(3)
    d = Eagle3Drafter(cfg, own_embedding=True)
    save_drafter(d, tmp_path / "narrow", dtype="fp32", include_embedding=True)
    export_drafter(tmp_path / "narrow", "speculators", tmp_path / "s", target_dir=target_dir)
    export_drafter(tmp_path / "s", "eagle3", tmp_path / "back", target_dir=target_dir)
    assert same_tensors(load_tensors(tmp_path / "narrow"), load_tensors(tmp_path / "back"))
    assert json.loads((tmp_path / "s" / "config.json").read_text())["target_hidden_size"] == 64
    assert torch.equal(draft_logits(tmp_path / "narrow", target), draft_logits(tmp_path / "back", target))
    assert any("target_hidden_size" in n for n in engine_ignored_keys(cfg, "speculators"))


def test_speculators_without_norm_before_residual_reads_as_true(pair, tmp_path):
    """vLLM's default when the key is missing; our reader follows it so such files mean the same here."""
    target_dir, drafter_dir, _ = pair
    export_drafter(drafter_dir, "speculators", tmp_path / "s", target_dir=target_dir)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    cfg.pop("norm_before_residual")
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "s").cfg.norm_before_residual is True


def test_every_layout_generates_the_same_tokens(pair, tmp_path):
    """generate/serve load any layout directly: the same greedy tokens and the same acceptance."""
    from eaglespec.api import generate, load_engine

    target_dir, drafter_dir, _ = pair
    export_drafter(drafter_dir, "speculators", tmp_path / "s", target_dir=target_dir)
    export_drafter(tmp_path / "s", "eagle3", tmp_path / "a", target_dir=target_dir)
    prompt = [[5, 17, 42, 8, 77, 3, 19, 64, 11, 2]]
    runs = []
    for d in (drafter_dir, tmp_path / "s", tmp_path / "a"):
        engine = load_engine(target_dir, d, mode="tree", adaptive=False, dtype="fp32")
        out = generate(engine, prompt, max_new_tokens=24)
        runs.append((out.results[0].output_ids, out.stats.accepted_per_pos))
    plain = generate(load_engine(target_dir, None, mode="off", dtype="fp32"), prompt, max_new_tokens=24)
    assert runs[0] == runs[1] == runs[2] and runs[0][0] == plain.results[0].output_ids


# -- import layouts -------------------------------------------------------------------------------
def test_eagle_config_nesting_and_reference_bin_load(pair, tmp_path):
    """EAGLE's own layout: pytorch_model.bin (read with weights_only=True), LlamaForCausalLM architecture,
    aux ids and norm_before_fc-style keys nested in eagle_config."""
    target_dir, drafter_dir, target = pair
    ref = tmp_path / "ref"
    ref.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    cfg["target_hidden_size"] = 64
    (ref / "config.json").write_text(json.dumps(cfg))
    torch.save(load_tensors(drafter_dir), ref / "pytorch_model.bin")
    d = load_drafter(ref, target=target)
    assert d.cfg.aux_layer_ids == [1, 3, 4]
    export_drafter(ref, "eagle3", tmp_path / "out", target_dir=target_dir)
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert same_tensors(load_tensors(drafter_dir), load_tensors(tmp_path / "out"))


class NotATensor:  # anything a pickle could smuggle in
    pass


def test_bin_with_objects_is_refused(pair, tmp_path):
    _, drafter_dir, _ = pair
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((drafter_dir / "config.json").read_text())
    torch.save({**load_tensors(drafter_dir), "payload": NotATensor()}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_drafter(bad)


def test_drafter_without_fc_is_refused_with_reason(pair, tmp_path):
    _, drafter_dir, _ = pair
    d = tmp_path / "e2"
    d.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["eagle_config"] = {"use_aux_hidden_state": False}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="use_aux_hidden_state"):
        load_drafter(d)


def test_mismatched_target_is_refused_before_writing(pair, tmp_path):
    _, drafter_dir, _ = pair
    other = save_hf(hf_tiny("llama", layers=4, vocab=80), tmp_path / "other")
    with pytest.raises(CheckpointError, match="vocab_size"):
        export_drafter(drafter_dir, "eagle3", tmp_path / "out", target_dir=other)
    assert not (tmp_path / "out").exists()


# -- gguf -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    files = export_drafter(EAGLE3, "gguf", out, target_dir=TARGET, outtype="f32")
    return files


def read_gguf(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in r.tensors}
    return kv, tensors


def gguf_array(t) -> np.ndarray:
    """A GGUF tensor back in PyTorch's [out, in] order (GGUF lists dimensions innermost first)."""
    return np.array(t.data).reshape([int(n) for n in reversed(t.shape)])


def test_gguf_target_reads_back_as_our_weights(bundled_gguf):
    kv, tensors = read_gguf(bundled_gguf[0])
    cfg = json.loads((TARGET / "config.json").read_text())
    assert kv["general.architecture"] == "llama" and kv["llama.block_count"] == cfg["num_hidden_layers"]
    assert kv["llama.rope.freq_base"] == cfg["rope_parameters"]["rope_theta"]
    assert kv["tokenizer.ggml.pre"] == "gpt-2" and len(kv["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    ours = load_tensors(TARGET)
    q = torch.from_numpy(gguf_array(tensors["blk.3.attn_q.weight"]).copy())
    assert torch.equal(q, permute_rope_rows(ours["model.layers.3.self_attn.q_proj.weight"].float(), 4))
    assert torch.equal(torch.from_numpy(gguf_array(tensors["token_embd.weight"]).copy()),
                       ours["model.embed_tokens.weight"].float())  # fmt: skip
    assert "output.weight" not in tensors  # tied embeddings: llama.cpp reuses token_embd


def test_gguf_drafter_keys_and_absolute_d2t(bundled_gguf):
    kv, tensors = read_gguf(bundled_gguf[1])
    d = load_drafter(EAGLE3)
    assert kv["general.architecture"] == "eagle3"
    assert list(kv["eagle3.target_layers"]) == [2, 4, 5]  # capture-before ids of the 8-layer target
    assert kv["eagle3.target_hidden_size"] == 256 and kv["eagle3.norm_before_residual"] is False
    d2t = np.array(tensors["d2t"].data)
    assert np.array_equal(d2t, d.draft_to_target.numpy())  # absolute target ids, not offsets
    assert "t2d" not in tensors and len(tensors) == 14


def test_gguf_refuses_eagle31_before_writing(tmp_path, capsys):
    rc = main(["export", str(EAGLE31), "--format", "gguf", "--out", str(tmp_path / "g"), "--target", str(TARGET)])
    assert rc == 2 and not (tmp_path / "g").exists()
    assert "no fc_norm mapping" in capsys.readouterr().err


def test_gguf_tokenizer_from_an_existing_target_gguf(bundled_gguf, pair, tmp_path):
    # a target without a GPT-2 byte-level tokenizer needs --target-gguf ...
    target_dir, drafter_dir, _ = pair  # its HF target has no tokenizer.json at all
    with pytest.raises(CheckpointError, match="--target-gguf"):
        export_drafter(_eagle3_copy(drafter_dir, tmp_path), "gguf", tmp_path / "x", target_dir=target_dir)
    # ... whose tokenizer is then copied, key for key
    files = export_drafter(EAGLE3, "gguf", tmp_path / "y", target_dir=TARGET, target_gguf=bundled_gguf[0])
    assert [f.name for f in files] == ["drafter-f32.gguf"]
    ref, _ = read_gguf(bundled_gguf[1])
    got, _ = read_gguf(files[0])
    tok = [k for k in ref if k.startswith("tokenizer.")]
    assert tok and all(got[k] == ref[k] for k in tok)


def _eagle3_copy(drafter_dir, tmp_path) -> Path:
    """The tiny EAGLE-3.1 drafter with the 3.1 switches off (an EAGLE-3 drafter llama.cpp could run)."""
    d = tmp_path / "tiny-e3"
    d.mkdir(exist_ok=True)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg.pop("fc_norm", None), cfg.pop("norm_output", None)
    (d / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file({k: v for k, v in load_tensors(drafter_dir).items() if not k.startswith("fc_norm")},
              str(d / "model.safetensors"))  # fmt: skip
    return d


# -- cli and speculation length ---------------------------------------------------------------------
def test_cli_export_prints_serving_commands(pair, tmp_path, capsys):
    target_dir, drafter_dir, _ = pair
    rc = main(["export", str(drafter_dir), "--format", "eagle3", "--out", str(tmp_path / "e"), "--target",
               str(target_dir), "--num-speculative-tokens", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "# vLLM" in out and "# SGLang" in out
    vllm = next(line for line in out.splitlines() if line.startswith("vllm serve"))
    spec = json.loads(vllm.split("--speculative-config ")[1].strip("'"))
    assert spec == {"method": "eagle3", "model": str(tmp_path / "e"), "num_speculative_tokens": 3}
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in out


def test_best_chain_length_trades_acceptance_against_cost():
    from eaglespec.speculation.chain_length import best_chain_length

    acceptance = [0.9, 0.8, 0.1, 0.05]
    # free drafting and flat verification: every accepted token pays, so the deepest chain wins
    assert best_chain_length(acceptance, 0.0, lambda n: 1.0)[0] == 4
    # drafting at 30% of a verification: tokens/step 1.9, 2.7, 2.8 at costs 1.3, 1.6, 1.9 -> k = 2
    k, tokens, speed = best_chain_length(acceptance, 0.3, lambda n: 1.0)
    assert k == 2 and tokens[:3] == pytest.approx([1.9, 2.7, 2.8])
    assert speed[1] == pytest.approx(2.7 / 1.6)


# -- external checks (the other tools' own code; skipped with the reason when their environment is absent) ---
def _llamacpp_reason():
    from eaglespec.bench.peers.llamacpp import not_built_reason

    return not_built_reason()


def _speculators_reason():
    from eaglespec.bench.peers.interop import speculators_unavailable

    return speculators_unavailable()


needs_llamacpp = pytest.mark.skipif(_llamacpp_reason() is not None, reason=_llamacpp_reason() or "")
needs_speculators = pytest.mark.skipif(_speculators_reason() is not None, reason=_speculators_reason() or "")


def gguf_content(path):
    """Every key and tensor of a GGUF file except the display name (the converter title-cases folder names)."""
    kv, tensors = read_gguf(path)
    kv.pop("general.name")
    data = {n: (t.tensor_type.name, [int(x) for x in t.shape], np.array(t.data).tobytes()) for n, t in tensors.items()}
    return kv, data


@needs_llamacpp
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_equals_llamacpp_converter_output(outtype, tmp_path):
    from eaglespec.bench.peers.llamacpp import llamacpp_root
    from eaglespec.export.llamacpp_convert import convert_drafter, convert_target

    ours = export_drafter(EAGLE3, "gguf", tmp_path, target_dir=TARGET, outtype=outtype)
    root = llamacpp_root()
    theirs = [convert_target(root, TARGET, outtype), convert_drafter(root, EAGLE3, TARGET, outtype)]
    for a, b in zip(ours, theirs):
        assert gguf_content(a) == gguf_content(b), f"{a.name} differs from llama.cpp's {b.name}"


@needs_llamacpp
def test_llamacpp_runs_our_gguf_export_with_our_greedy_output(tmp_path):
    from eaglespec.api import load_tokenizer
    from eaglespec.bench.peers.interop import check_llamacpp
    from eaglespec.suites import load_prompts

    by_cat, _ = load_prompts(["chat", "code", "docs_qa"], load_tokenizer(TARGET), limit=1, max_new_tokens=32,
                             max_length=4096)  # fmt: skip
    prompts = [p.ids for ps in by_cat.values() for p in ps]
    r = check_llamacpp(EAGLE3, TARGET, tmp_path, prompts, max_new_tokens=32, k=4, threads=torch.get_num_threads())
    assert r["plain_equal_prompts"] == r["eagle3_equal_prompts"] == r["ours_chain_equal_prompts"] == len(prompts)
    ours, theirs = r["acceptance_eaglespec"]["tau"], r["acceptance_llamacpp"]["tau"]
    assert abs(ours - theirs) < 0.5, (ours, theirs)  # same drafter, same target: acceptance in line


@needs_speculators
@pytest.mark.parametrize("drafter", [EAGLE31, EAGLE3], ids=["eagle3.1", "eagle3"])
def test_speculators_loads_our_export_and_computes_our_logits(drafter, tmp_path):
    from eaglespec.api import load_tokenizer
    from eaglespec.bench.peers.interop import FP32_ATOL, check_speculators

    tok = load_tokenizer(TARGET)
    ids = torch.tensor([tok.encode("def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n")])
    r = check_speculators(drafter, TARGET, tmp_path, ids=ids, steps=3)
    assert r["loaded_tensors_bit_exact"], r
    assert max(r["max_abs_logit_diff_per_step"]) <= FP32_ATOL, r
    assert r["flags"]["fc_norm"] == (drafter == EAGLE31) and r["flags"]["norm_before_residual"] is False
