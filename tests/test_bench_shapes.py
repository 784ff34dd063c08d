"""Built-in shapes (parameter counts without allocating, a tiny variant end to end), the
--synthetic-acceptance / --shape CLI checks, and the measured-bandwidth reference in the report."""

import json

import pytest
import torch

from eaglespec.bench import hardware, shapes
from eaglespec.bench.shapes import SHAPES, Shape, ensure_shape, hf_config, param_count
from eaglespec.cli import main
from eaglespec.models.checkpoint import load_drafter, load_target
from eaglespec.models.llama import TargetConfig
from eaglespec.settings import default_models_dir

TINY = Shape("qwen2", {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                       "tie_word_embeddings": True, "use_sliding_window": False},
             draft_vocab=32, params=0, note="test-only tiny Qwen2")  # fmt: skip


@pytest.fixture
def fake_bandwidth(monkeypatch, tmp_path):
    """A private cache and a fixed 20 GB/s 'measurement' (the real one reads 1 GiB)."""
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(hardware, "measure_read_bandwidth", lambda: calls.append(1) or 20.0)
    return calls


@pytest.mark.parametrize("name", list(SHAPES))
def test_documented_parameter_counts_without_allocating(name):
    shape = SHAPES[name]
    cfg = hf_config(shape)
    assert param_count(cfg) == shape.params
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.params  # tied embedding counted once
    t = TargetConfig.from_hf(cfg)
    assert t.tie_word_embeddings and t.head_dim == 64 and t.sliding_window is None
    assert t.qkv_bias == (name == "qwen2-365m")


def test_documented_figures():
    assert round(SHAPES["qwen2-365m"].params / 1e6) == 365
    assert round(SHAPES["llama-3.2-1b"].params / 1e7) == 124  # Llama-3.2-1B: 1.24B
    rope = hf_config(SHAPES["llama-3.2-1b"]).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500000.0


def test_tiny_shape_is_written_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    target_dir, draft_dir = ensure_shape("tiny", tmp_path / "tiny")
    stamp = (target_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_shape("tiny", tmp_path / "tiny") == (target_dir, draft_dir)
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    from safetensors import safe_open

    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.bfloat16
        assert "lm_head.weight" not in f.keys()  # tied
        std = f.get_tensor("model.layers.0.mlp.up_proj.weight").float().std().item()
    assert std == pytest.approx(shapes.INIT_STD, rel=0.1)
    target = load_target(target_dir)
    assert sum(p.numel() for p in target.parameters()) == param_count(hf_config(TINY))
    drafter = load_drafter(draft_dir, target=target)
    assert drafter.cfg.eagle_version == "EAGLE-3.1" and drafter.cfg.draft_vocab_size == 32
    # peaked random draft logits: EAGLE-2 trees of 16 nodes (mostly) reach their full depth 4
    from eaglespec.engine import Engine, Request
    from eaglespec.speculation import proposer as proposer_mod
    from eaglespec.speculation.config import TreeShape

    depths, build = [], proposer_mod.build_tree
    monkeypatch.setattr(proposer_mod, "build_tree", lambda *a: depths.append(build(*a).depth.max()) or build(*a))
    engine = Engine(target, drafter, mode="tree", tree=TreeShape(4, 4, 16), adaptive=False,
                    synthetic_acceptance=[1.0] * 4)  # fmt: skip
    engine.generate([Request(list(range(1, 17)), 16)])
    assert depths and min(depths) >= 3 and sum(d == 4 for d in depths) > len(depths) / 2, depths
    # same seed, same weights
    again, _ = ensure_shape("tiny", tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (target_dir / "model.safetensors").read_bytes()


def test_bench_on_a_shape_with_synthetic_acceptance(tmp_path, monkeypatch, fake_bandwidth):
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    out = tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--synthetic-acceptance", "0.8,0.6,0.4", "--methods", "chain,tree",
               "--limit", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--no-adaptive",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in report["results"] if r["category"] == "all"}
    assert set(rows) == {"plain", "chain[EAGLE-3.1]", "tree[EAGLE-3.1]"}  # plain added as the baseline
    assert all(r["new_tokens"] == 24 for r in rows.values())  # no EOS: always max_new_tokens
    assert report["shape"]["name"] == "tiny" and report["config"]["prompts_per_category"] == {"random": 2}
    assert (tmp_path / "cache" / "shapes" / "tiny" / "target" / "config.json").is_file()
    md = (out / "bench.md").read_text()
    assert "built-in shape `tiny`" in md and "random token ids" in md


def test_bundled_target_synthetic_rows_are_not_lossless(tmp_path, fake_bandwidth):
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(default_models_dir() / "target"), "--synthetic-acceptance",
               "0.9,0.8,0.7,0.6", "--methods", "plain,chain", "--limit", "1", "--max-new-tokens", "16",
               "--categories", "chat", "--out", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    methods = {m["name"]: m for m in report["methods"]}
    chains = [m for m in methods.values() if m["kind"] == "chain"]
    assert chains and all(not m["lossless"] and m["settings"]["synthetic_acceptance"] == [0.9, 0.8, 0.7, 0.6]
                          for m in chains)  # fmt: skip
    assert methods["plain"]["lossless"]
    check = report["lossless_check"]
    assert check["passed"] is not False and not check["mismatches"]  # synthetic rows are left out
    assert all(m["name"] not in check.get("methods", []) for m in chains)
    md = (out / "bench.md").read_text()
    assert "(**synthetic acceptance, not lossless**)" in md
    # the physical reference: measured once (cached), and each row's share of it
    assert report["memory_bandwidth"]["read_gb_s"] == 20.0 and fake_bandwidth == [1]
    for r in report["results"]:
        assert r["bandwidth_pct"] == pytest.approx(100 * r["bandwidth_gb_s"] / 20.0)
    assert "Memory read bandwidth: 20.0 GB/s" in md and "% of mem BW" in md


@pytest.mark.parametrize("args, needle", [
    (["--synthetic-acceptance", "0.5,0.9"], "non-increasing"),
    (["--synthetic-acceptance", "0.9,1.5"], "in [0, 1]"),
    (["--synthetic-acceptance", "0.9,x"], "comma-separated numbers"),
    (["--synthetic-acceptance", ","], "empty"),
    (["--synthetic-acceptance", "0.9", "--sweep", "batch"], "cannot be used with --sweep"),
    (["--shape", "gpt-17"], "unknown shape 'gpt-17'"),
    (["--shape", "qwen2-365m", "--target", "x"], "--shape replaces --target"),
    (["--shape", "qwen2-365m", "--methods", "plain,hf_generate"], "peers ['hf_generate']"),
    (["--shape", "qwen2-365m", "--prompt-len", "0"], "--prompt-len must be >= 1"),
])  # fmt: skip
def test_bad_flags_exit_2_with_a_clear_message(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path))  # nothing may be built before the check
    assert main(["bench", *args, "--out", str(tmp_path / "out")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "shapes").exists()


def test_bandwidth_is_cached_per_cpu_threads_and_torch(fake_bandwidth, tmp_path, monkeypatch):
    assert hardware.memory_bandwidth_gbs() == 20.0
    assert hardware.memory_bandwidth_gbs() == 20.0 and fake_bandwidth == [1]
    saved = json.loads((tmp_path / "cache" / "hardware.json").read_text())
    key = hardware.cache_key()
    assert hardware.cpu_name() in key and f"threads={torch.get_num_threads()}" in key and torch.__version__ in key
    assert saved[key]["read_gb_s"] == 20.0 and "torch.sum" in saved[key]["method"]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count: measured again
    assert hardware.memory_bandwidth_gbs() == 20.0 and fake_bandwidth == [1, 1]


def test_real_measurement_is_positive_on_a_small_buffer():
    assert hardware.measure_read_bandwidth(nbytes=1 << 22, repeats=2) > 0.1


def test_gguf_source_links_the_shape_and_adds_the_bundled_tokenizer(tmp_path):
    """llama.cpp's converter needs a tokenizer; a shape with the bundled vocabulary size borrows it."""
    target = tmp_path / "qwen2-365m" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"vocab_size": 8192}))
    (target / "model.safetensors").write_bytes(b"weights")
    src = shapes.gguf_source("qwen2-365m", target)
    assert (src / "model.safetensors").is_symlink() and (src / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert json.loads((src / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert shapes.gguf_source("qwen2-365m", target) == src  # a second call reuses it
    with pytest.raises(ValueError, match="tokenizer with 128256 entries"):
        shapes.gguf_source("llama-3.2-1b", target)
