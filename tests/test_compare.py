"""The drafter comparison protocol (issue 14): perturbed renderers, bootstrap intervals and ratios, and a
whole run on tiny real models (two variants x two seeds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eaglespec.bench import bootstrap
from eaglespec.bench.templates import FORMATS

CONV = [{"role": "user", "content": "Where is the station?"}, {"role": "assistant", "content": "Two blocks north."},
        {"role": "user", "content": "Thanks, and the museum?"}]  # fmt: skip


def own_template(messages):
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


def test_every_perturbed_format_keeps_the_conversation_and_changes_the_template():
    assert len(FORMATS) >= 5
    seen = set()
    for name, render in FORMATS.items():
        text = render(CONV)
        assert all(m["content"] in text for m in CONV), name
        assert text.index("Where is the station?") < text.index("Two blocks north.") < text.index("the museum?")
        assert text != own_template(CONV) and text not in seen, name
        seen.add(text)
    # the three "own markup" formats change exactly one thing each
    assert "<|customer|>" in FORMATS["own_roles_renamed"](CONV) and "<|user|>" not in FORMATS["own_roles_renamed"](CONV)
    assert FORMATS["own_system_prompt"](CONV).endswith(own_template(CONV))
    spaced = FORMATS["own_whitespace"](CONV)
    assert "<|user|>\n\n  **Where is the station?**" in spaced and spaced.endswith("<|assistant|>\n\n  ")


def test_bootstrap_tau_ratio_and_intervals():
    # (drafts, accepted) per prompt: a accepts 2 per draft over all, b 1 per draft
    a = np.array([[[10, 10], [10, 20], [10, 30]], [[10, 12], [10, 18], [10, 30]]], dtype=float)  # 2 seeds
    b = np.array([[[10, 5], [10, 10], [10, 15]]], dtype=float)  # 1 seed
    assert bootstrap.tau_of(a) == pytest.approx(1 + 120 / 60)
    assert bootstrap.tau_of(b) == pytest.approx(2.0)
    s = bootstrap.summarize({"a": a, "b": b}, "b", replicates=500)
    assert s["a"]["ratio"] == pytest.approx(3.0 / 2.0)
    lo, hi = s["a"]["ratio_ci"]
    assert lo <= s["a"]["ratio"] <= hi and lo > 1.0  # a is ahead on every prompt: the interval stays above 1
    lo, hi = s["b"]["tau_ci"]
    assert lo <= 2.0 <= hi
    same = bootstrap.summarize({"x": b, "y": b.copy()}, "y", replicates=200)
    assert same["x"]["ratio_ci"] == pytest.approx((1.0, 1.0))
    with pytest.raises(ValueError, match="same prompts"):
        bootstrap.bootstrap({"a": a, "c": b[:, :2]})


def test_interval_widens_with_disagreement_between_seeds():
    steady = np.array([[[10, 10]] * 6, [[10, 10]] * 6], dtype=float)
    split = np.array([[[10, 0]] * 6, [[10, 20]] * 6], dtype=float)
    w = lambda c: np.subtract(*bootstrap.interval(bootstrap.bootstrap({"v": c}, replicates=400)[:, 0])[::-1])
    assert w(steady) == 0 and w(split) > 0.5


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    import torch

    from eaglespec.models.checkpoint import load_target, save_drafter
    from eaglespec.models.drafter import Eagle3Drafter
    from eaglespec.models.drafter_config import new_drafter_config
    from eaglespec.toy import make_toy_models

    root = tmp_path_factory.mktemp("cmp")
    target_dir, _ = make_toy_models(root)
    target = load_target(target_dir)
    variants = {}
    for name, on in (("e31", True), ("e3", False)):
        for seed in (0, 1):
            torch.manual_seed(seed)
            d = Eagle3Drafter(new_drafter_config(target.cfg, fc_norm=on, norm_output=on))
            save_drafter(d, root / f"{name}-s{seed}", dtype="fp32")
            variants.setdefault(name, []).append(str(root / f"{name}-s{seed}"))
    return target_dir, variants


def test_protocol_runs_and_summarizes_on_tiny_models(toy, tmp_path):
    from eaglespec.api import load_tokenizer
    from eaglespec.bench.compare import build_prompts, run, summarize_run

    target_dir, variants = toy
    prompts = build_prompts(load_tokenizer(target_dir), conversations=1, formats=("chatml", "own_roles_renamed"),
                            long_limit=0, max_length=2048)  # fmt: skip
    conds = {p.condition for p in prompts}
    assert conds == {"standard", "perturbed/chatml", "perturbed/own_roles_renamed"}
    out = run(target_dir, variants, tmp_path / "cmp", prompts, shapes=("chain7",), max_new_tokens=6)
    files = sorted(p.name for p in out.glob("*--*.json"))
    assert files == ["e3--e3-s0.json", "e3--e3-s1.json", "e31--e31-s0.json", "e31--e31-s1.json"]
    mtime = (out / "e31--e31-s0.json").stat().st_mtime_ns
    run(target_dir, variants, out, prompts, shapes=("chain7",), max_new_tokens=6)  # resumes: nothing redone
    assert (out / "e31--e31-s0.json").stat().st_mtime_ns == mtime
    report = summarize_run(out, "e3", replicates=100)
    assert report["outputs_identical_across_drafters"]  # speculation never changes the target's output
    chain = report["chain7"]
    assert set(chain) == conds | {"perturbed"}
    e31 = chain["perturbed"]["e31"]
    assert e31["seeds"] == 2 and e31["prompts"] == 2 * 3 * 1  # 2 formats x 3 suites x 1 conversation
    assert e31["ratio_ci"][0] <= e31["ratio"] <= e31["ratio_ci"][1]
    rec = json.loads((out / "e31--e31-s0.json").read_text())["measured"]["chain7"]
    drafts = sum(r[0] for r in rec.values())
    assert drafts > 0 and len(e31["per_position"]) <= 7


def test_rare_tokens_counts_tokens_outside_the_draft_vocabulary(tmp_path):
    from eaglespec.bench.compare import rare_tokens

    (tmp_path / "prompts.json").write_text(json.dumps([["chat/00", "standard", 9], ["chat/00@vicuna",
                                                       "perturbed/vicuna", 9]]))  # fmt: skip
    rows = {"chat/00": [4, 6, [3, 2, 1], [1, 2, 7, 3, 9, 4, 5, 6, 2, 1], 0, 0],  # 7 and 9 are out of vocabulary
            "chat/00@vicuna": [2, 1, [1], [9, 9, 1], 5, 1]}  # fmt: skip
    (tmp_path / "e31--d.json").write_text(json.dumps({"variant": "e31", "drafter": "d", "measured": {"tree": rows}}))
    mask = np.ones(10, dtype=bool)
    mask[[7, 9]] = False
    seen = []
    report = rare_tokens(tmp_path, lambda d: seen.append(d) or mask)
    assert seen == ["d"]
    std, pert = report["e31--d"]["tree"]["standard/chat"], report["e31--d"]["tree"]["perturbed/vicuna"]
    assert std["tokens"] == 10 and std["oov_fraction"] == pytest.approx(0.2) and std["oov_per_step"] == 0.5
    assert std["tau"] == pytest.approx(1 + 6 / 4)
    assert pert["oov_fraction"] == pytest.approx(2 / 3) and pert["oov_per_step"] == 1.0
    assert (pert["copied_drafted"], pert["copied_accepted"]) == (5, 1)
    assert report["e31--d"]["tree"]["perturbed"] == pert  # the pooled group of one format


def test_shape_ratios_compare_two_shapes_of_the_same_drafter(tmp_path):
    from eaglespec.bench.compare import shape_ratios

    (tmp_path / "prompts.json").write_text(json.dumps([["a", "standard", 5], ["b", "standard", 5]]))
    measured = {"tree": {"a": [4, 4, [], [1], 0, 0], "b": [4, 4, [], [1], 0, 0]},  # tau 2
                "tree+ngram": {"a": [2, 4, [], [1], 3, 2], "b": [2, 4, [], [1], 3, 2]}}  # tau 3  # fmt: skip
    (tmp_path / "e31--d.json").write_text(json.dumps({"variant": "e31", "drafter": "d", "measured": measured}))
    r = shape_ratios(tmp_path, "tree", replicates=50)["e31"]["tree+ngram"]["standard"]
    assert r["ratio"] == pytest.approx(1.5) and r["ratio_ci"] == pytest.approx((1.5, 1.5))
    with pytest.raises(ValueError, match="not measured"):
        shape_ratios(tmp_path, "chain7")
