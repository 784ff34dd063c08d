"""The drafter comparison protocol (issue 14): acceptance of drafter variants, each trained with several
seeds, on the same prompts, per condition and speculation shape, with bootstrap intervals.

Conditions (all from held-out test-split suites):
- standard: the chat, code and docs_qa suites, chats rendered with the target's own template;
- perturbed/<format>: the held-out conversations (chat, docs_qa, summarization suites) rendered in each
  format of bench/templates.py, none of which the drafters saw in training;
- long: the long_context suite's shortest documents (2K-6K tokens).
Shapes: forced, never switched off (adaptive False), greedy: chain7 (a chain of 7), tree (the default
EAGLE-2 tree: depth 4, top-k 4, 16 nodes), tree7 (depth 7, top-k 4, 32 nodes), and tree+ngram (the default
tree plus up to 8 tokens copied from the context: the hybrid proposer, for the rare-token study).
Per prompt we keep (drafts, accepted) and the accepted counts per position; tau and ratios come from
bench/bootstrap.py. Greedy verification makes each number a deterministic function of drafter and prompt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..speculation.config import TreeShape
from .templates import FORMATS

# name -> (mode, chain length, tree shape, context n-gram tokens merged per step: the hybrid proposer)
SHAPES = {"chain7": ("chain", 7, None, 0), "tree": ("tree", None, TreeShape(4, 4, 16), 0),
          "tree7": ("tree", None, TreeShape(7, 4, 32), 0),
          "tree+ngram": ("tree", None, TreeShape(4, 4, 16), 8)}  # fmt: skip
STANDARD = ("chat", "code", "docs_qa")
CONVERSATIONS = ("chat", "docs_qa", "summarization")
PAPER_RATIOS = {"perturbed": "up to 2x", "standard": "1.10x", "long": "1.18x"}  # arXiv 2605.09992 (abstract)


@dataclass
class Prompt:
    id: str
    condition: str
    ids: list[int]


def build_prompts(tokenizer, *, conversations: int | None = None, formats=tuple(FORMATS), long_limit: int = 3,
                  max_length: int = 32768, max_new_tokens: int = 32) -> list[Prompt]:  # fmt: skip
    """Every condition's prompts, tokenized; `conversations` caps the held-out conversations per suite."""
    from ..suites import load_suite, tokenize_suite

    out = []
    for cat in STANDARD:
        out += [Prompt(p.id, "standard", p.ids) for p in tokenize_suite(load_suite(cat), cat, tokenizer)]
    convs = [it for cat in CONVERSATIONS for it in load_suite(cat, conversations)]
    for name in formats:
        render = FORMATS[name]
        for it in convs:
            ids = tokenizer.encode(render(it["messages"]), add_special_tokens=False)
            out.append(Prompt(f"{it['id']}@{name}", f"perturbed/{name}", ids))
    if long_limit:
        out += [Prompt(p.id, "long", p.ids)
                for p in tokenize_suite(load_suite("long_context", long_limit), "long_context", tokenizer)]  # fmt: skip
    return [p for p in out if len(p.ids) + max_new_tokens <= max_length]


def measure_drafter(target, drafter, prompts: list[Prompt], *, shapes=tuple(SHAPES), max_new_tokens: int = 32,
                    dtype: str = "fp32", records: dict | None = None,
                    draft_window: int | None = None) -> dict:  # fmt: skip
    """{shape: {prompt id: [drafts, accepted, [accepted per position ...], output ids, copied draft tokens,
    copied tokens accepted]}} for one drafter. records: a dict to replay the target from (bench/replay.py;
    filled with each prompt's record on first use and shared across drafters), None to run the target;
    draft_window: the drafter's attention window (None: its own, 0: none)."""
    from ..api import generate, load_engine
    from ..engine import Engine
    from .replay import MARGIN, ReplayTarget, record

    result = {}
    for shape in shapes:
        mode, k, tree, ngram = SHAPES[shape]
        engine = load_engine(target, drafter, mode=mode, chain_k=k or 4, tree=tree, adaptive=False, dtype=dtype,
                             ngram_tokens=ngram, draft_window=draft_window)  # fmt: skip
        replay = None
        if records is not None:
            replay = ReplayTarget(engine.target)
            engine = Engine(replay, engine.drafter, engine.spec, tokenizer=engine.tokenizer)
        rows = {}
        for p in prompts:
            if replay is not None:
                key = (str(target), p.id, len(p.ids), max_new_tokens + MARGIN, tuple(replay.aux_layers))
                if key not in records:
                    records[key] = record(replay.base, p.ids, max_new_tokens + MARGIN)
                replay.play(records[key], p.ids)
            out = generate(engine, [p.ids], max_new_tokens=max_new_tokens)
            s = out.stats
            rows[p.id] = [s.drafts, s.accepted, list(s.accepted_per_pos), out.results[0].output_ids,
                          s.copied_tokens, s.copied_accepted]
        result[shape] = rows
    return result


def run(target, variants: dict[str, list[str]], out_dir, prompts: list[Prompt], *, replay: bool = False,
        records_dir=None, **kw) -> Path:  # fmt: skip
    """Measure every drafter of every variant (resumable: one JSON per drafter, kept when present); replay:
    the target's greedy continuations are recorded once and replayed for every drafter (bench/replay.py),
    kept in records_dir when given (shared by processes measuring other drafters, and by a resumed run)."""
    from .replay import RecordStore

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps([[p.id, p.condition, len(p.ids)] for p in prompts]))
    records = (RecordStore(records_dir) if records_dir else {}) if replay else None
    for name, drafters in variants.items():
        for d in drafters:
            path = out / f"{name}--{Path(d).parent.name if Path(d).name == 'final' else Path(d).name}.json"
            if path.is_file():
                continue
            t0 = time.time()
            rec = {"variant": name, "drafter": str(d), "replay": replay,
                   "measured": measure_drafter(target, d, prompts, records=records, **kw)}  # fmt: skip
            rec["seconds"] = round(time.time() - t0, 1)
            path.write_text(json.dumps(rec))
    return out


def load_counts(out_dir) -> tuple[dict, dict, bool]:
    """From run()'s records: counts[variant][shape][condition] = array [seeds, prompts, 2] of (drafts,
    accepted); positions[variant][shape][condition] = (drafts, accepted at each position summed); and
    whether every drafter produced the same output on every prompt (the target's own greedy output)."""
    out = Path(out_dir)
    by_cond: dict[str, list[str]] = {}
    for pid, cond, _ in json.loads((out / "prompts.json").read_text()):
        by_cond.setdefault(cond, []).append(pid)
    counts: dict = {}
    positions: dict = {}
    outputs: dict = {}
    for path in sorted(out.glob("*--*.json")):
        rec = json.loads(path.read_text())
        v = rec["variant"]
        for shape, rows in rec["measured"].items():
            for pid, row in rows.items():
                outputs.setdefault(pid, set()).add(tuple(row[3]))
            for cond, ids in by_cond.items():
                arr = np.array([rows[i][:2] for i in ids], dtype=np.float64)
                counts.setdefault(v, {}).setdefault(shape, {}).setdefault(cond, []).append(arr)
                per_pos = np.zeros(max((len(rows[i][2]) for i in ids), default=0))
                for i in ids:
                    per_pos[: len(rows[i][2])] += rows[i][2]
                drafts, acc = positions.setdefault(v, {}).setdefault(shape, {}).get(cond, (0.0, np.zeros(0)))
                width = max(len(acc), len(per_pos))
                total = np.pad(acc, (0, width - len(acc))) + np.pad(per_pos, (0, width - len(per_pos)))
                positions[v][shape][cond] = (drafts + arr[:, 0].sum(), total)
    counts = {v: {s: {c: np.stack(a) for c, a in cs.items()} for s, cs in ss.items()} for v, ss in counts.items()}
    identical = all(len(o) == 1 for o in outputs.values())
    return counts, positions, identical


def pooled_conditions(counts_for_shape: dict) -> dict:
    """Adds 'perturbed' (every perturbed format's prompts together) next to the per-format conditions."""
    out = dict(counts_for_shape)
    parts = [a for c, a in counts_for_shape.items() if c.startswith("perturbed/")]
    if parts:
        out["perturbed"] = np.concatenate(parts, axis=1)
    return out


def summarize_run(out_dir, baseline: str, *, replicates: int = 2000) -> dict:
    """{shape: {condition: {variant: tau, tau_ci, ratio, ratio_ci, per_position}}} over every variant measured,
    plus outputs_identical_across_drafters (lossless check: every drafter gave the target's own output)."""
    from .bootstrap import summarize

    counts, positions, identical = load_counts(out_dir)
    variants = list(counts)
    if baseline not in variants:
        raise ValueError(f"baseline variant {baseline!r} not measured (have {variants})")
    report: dict = {}
    for shape in counts[baseline]:
        conds = {v: pooled_conditions(counts[v][shape]) for v in variants}
        for cond in conds[baseline]:
            summary = summarize({v: conds[v][cond] for v in variants}, baseline, replicates=replicates)
            for v in variants:
                parts = [positions[v][shape][c] for c in positions[v][shape]
                         if c == cond or (cond == "perturbed" and c.startswith("perturbed/"))]  # fmt: skip
                drafts = sum(d for d, _ in parts)
                width = max((len(a) for _, a in parts), default=0)
                acc = sum((np.pad(a, (0, width - len(a))) for _, a in parts), np.zeros(width))
                summary[v]["per_position"] = [float(a / drafts) for a in acc] if drafts else []
            report.setdefault(shape, {})[cond] = summary
    report["outputs_identical_across_drafters"] = identical
    return report


def rare_tokens(out_dir, in_vocab_of) -> dict:
    """Out-of-draft-vocabulary tokens in run()'s records: {record: {shape: {group: tokens, oov_fraction,
    oov_per_step, tau, copied_drafted, copied_accepted}}}. `in_vocab_of(drafter path)` gives a boolean mask over
    the target vocabulary. A drafter can never propose a token outside its vocabulary, so each one the target
    writes ends its verification step: oov_per_step is the share of steps cut short by the vocabulary alone.
    Groups: standard prompts by suite, perturbed by format and pooled, long. Copied n-gram candidates (the hybrid
    proposer, shape tree+ngram) are not limited to the draft vocabulary."""
    out = Path(out_dir)
    conds = {pid: cond for pid, cond, _ in json.loads((out / "prompts.json").read_text())}
    report = {}
    for path in sorted(out.glob("*--*.json")):
        rec = json.loads(path.read_text())
        in_vocab = np.asarray(in_vocab_of(rec["drafter"]), dtype=bool)
        per: dict = {}
        for shape, rows in rec["measured"].items():
            for pid, (drafts, accepted, _, ids, copied, copied_acc) in rows.items():
                cond = conds[pid]
                names = ["standard/" + pid.split("/")[0]] if cond == "standard" else [cond]
                names += ["perturbed"] if cond.startswith("perturbed/") else []  # all formats pooled, too
                for group in names:
                    g = per.setdefault(shape, {}).setdefault(group, np.zeros(6))
                    g += [len(ids), int((~in_vocab[ids]).sum()) if ids else 0, drafts, accepted, copied, copied_acc]
        report[path.stem] = {
            shape: {g: {"tokens": int(v[0]), "oov_fraction": v[1] / v[0] if v[0] else 0.0,
                        "oov_per_step": v[1] / v[2] if v[2] else 0.0, "tau": 1 + v[3] / v[2] if v[2] else 1.0,
                        "copied_drafted": int(v[4]), "copied_accepted": int(v[5])} for g, v in sorted(groups.items())}
            for shape, groups in per.items()}  # fmt: skip
    return report


def shape_ratios(out_dir, baseline_shape: str, *, replicates: int = 2000) -> dict:
    """{variant: {shape: {condition: tau ratio to baseline_shape, interval}}}: what a shape (e.g. tree+ngram, the
    hybrid proposer) adds over another for the same drafters on the same prompts (prompts paired; with several
    seeds, seeds are resampled per shape as for two variants, which makes the interval conservative)."""
    from .bootstrap import summarize

    counts, _, _ = load_counts(out_dir)
    out: dict = {}
    for v, shapes in counts.items():
        if baseline_shape not in shapes:
            raise ValueError(f"shape {baseline_shape!r} not measured for {v} (have {sorted(shapes)})")
        base = pooled_conditions(shapes[baseline_shape])
        for shape in (s for s in shapes if s != baseline_shape):
            other = pooled_conditions(shapes[shape])
            for cond in base:
                s = summarize({"base": base[cond], "other": other[cond]}, "base", replicates=replicates)["other"]
                out.setdefault(v, {}).setdefault(shape, {})[cond] = {"ratio": s["ratio"], "ratio_ci": s["ratio_ci"]}
    return out
