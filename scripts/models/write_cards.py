#!/usr/bin/env python3
"""Measure the bundled default models and write their model cards (models/*/README.md).

Target card: size, training record (training_state.json + runs/target/log.jsonl), held-out loss per corpus
part (the test split, which neither the target nor the drafters saw), greedy sample generations.
Drafter cards: size, training record (the run's metrics.jsonl and the regen manifest), and tau per prompt
category, measured with the engine on held-out prompts built from the corpus test split, in one run with
both drafters on the same prompts. Writes `cards.json` next to this script's output for BENCHMARKS.md.

  python scripts/models/write_cards.py --target models/target \
      --drafter models/drafter-eagle3.1=runs/drafter-e31 --drafter models/drafter-eagle3=runs/drafter-e3
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def heldout_prompts(tokenizer, per_category: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """Prompts per category from data/corpus/<part>/test.jsonl (held out from all training)."""
    rng = random.Random(seed)

    def read(part):
        with open(ROOT / "data/corpus" / part / "test.jsonl") as f:
            return [json.loads(x) for x in f]

    out = {}
    chats = read("chat_chitchat") + read("chat_chatterbot")
    rng.shuffle(chats)
    out["chat"] = [tokenizer.apply_chat_template(c["messages"][:1], add_generation_prompt=True, tokenize=False)
                   for c in chats[:per_category]]  # fmt: skip
    for cat, part in (("code", "code_stdlib"), ("docs", "docs_python_rst")):
        docs = read(part)
        rng.shuffle(docs)
        out[cat] = [d["text"][:600] for d in docs[:per_category]]
    docs = read("docs_python_rst")
    rng.shuffle(docs)
    out["docs_qa"] = [tokenizer.apply_chat_template(
        [{"role": "user", "content": d["text"][:500] + "\n\nWhat is this about?"}], add_generation_prompt=True,
        tokenize=False) for d in docs[:per_category]]  # fmt: skip
    return {k: [tokenizer.encode(t, add_special_tokens=False) for t in v] for k, v in out.items()}


def heldout_loss(target_dir: Path, windows: int = 8, seq: int = 512) -> dict[str, float]:
    import numpy as np
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    res = {}
    for part_dir in sorted((ROOT / "data/tokens").iterdir()):
        f = part_dir / "test.bin"
        if not f.is_file() or f.stat().st_size < 2 * (seq + 2):
            continue
        arr = np.memmap(f, dtype=np.uint16, mode="r")
        offs = np.linspace(0, len(arr) - seq - 1, min(windows, max(1, (len(arr) - 1) // seq)), dtype=np.int64)
        x = torch.from_numpy(np.stack([np.asarray(arr[o : o + seq + 1], dtype=np.int64) for o in offs]))
        with torch.no_grad():
            logits = model(input_ids=x[:, :-1]).logits
        res[part_dir.name] = round(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))), 3)
    return res


def measure_taus(target_dir, drafters: dict[str, Path], prompts, max_new_tokens: int) -> dict:
    from eaglespec.api import generate, load_engine

    results = {}
    for name, ddir in {"plain": None, **drafters}.items():
        for mode in (("off",) if ddir is None else ("tree", "chain")):
            engine = load_engine(target_dir, ddir, mode=mode)
            engine.configure(adaptive=False)
            rec = {}
            outputs = {}
            for cat, ps in prompts.items():
                out = generate(engine, ps, max_new_tokens=max_new_tokens)
                s = out.stats
                outputs[cat] = [r.output_ids for r in out.results]
                rec[cat] = {"tau": round(s.tau, 3), "per_position": [round(a, 3) for a in s.per_position_acceptance],
                            "tokens_per_s": round(s.tokens_per_second, 1), "new_tokens": s.new_tokens}  # fmt: skip
            results[f"{name}/{mode}"] = {"categories": rec, "outputs": outputs}
    plain = results["plain/off"]["outputs"]
    for key, r in results.items():
        r["identical_to_plain"] = r["outputs"] == plain
        for cat, c in r["categories"].items():
            c["speedup"] = round(c["tokens_per_s"] / results["plain/off"]["categories"][cat]["tokens_per_s"], 3)
    return results


def samples(target_dir, prompts: list, max_new_tokens=48) -> list[tuple[str, str]]:
    from eaglespec.api import generate, load_engine, parse_inputs

    engine = load_engine(target_dir, None, mode="off")
    ids = parse_inputs(prompts, engine.tokenizer)
    out = generate(engine, ids, max_new_tokens=max_new_tokens)
    show = lambda p: p["messages"][-1]["content"] if "messages" in p else p["prompt"]
    return [(show(p), r.text) for p, r in zip(prompts, out.results)]


def params(path: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            shape = t.get_shape()
            n += int(torch.tensor(shape).prod()) if shape else 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / "models/target"))
    ap.add_argument("--drafter", action="append", default=[], help="MODEL_DIR=RUN_DIR")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out-json", default=str(ROOT / "models/cards.json"))
    ap.add_argument("--position-loss", help="JSON from scripts/target/position_loss.py to include (held-out loss "
                                            "per position bucket, up to 32K)")  # fmt: skip
    a = ap.parse_args()
    torch.manual_seed(0)
    target = Path(a.target)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    drafters = {}
    runs = {}
    for spec in a.drafter:
        mdir, _, rdir = spec.partition("=")
        drafters[Path(mdir).name] = Path(mdir)
        runs[Path(mdir).name] = Path(rdir) if rdir else None
    t0 = time.time()
    prompts = heldout_prompts(tok, a.per_category)
    taus = measure_taus(target, drafters, prompts, a.max_new_tokens)
    loss = heldout_loss(target)
    smp = samples(target, [{"messages": [{"role": "user", "content": "hi, how are you doing today?"}]},
                           {"messages": [{"role": "user", "content": "What is a Python list?"}]},
                           {"prompt": "def read_config(path):\n"},
                           {"prompt": "The json module"}])  # fmt: skip
    hw = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    state = json.loads((target / "training_state.json").read_text())
    card = {"target": {"params": params(target), "training_state": state, "heldout_loss": loss, "samples": smp},
            "position_loss": json.loads(Path(a.position_loss).read_text()) if a.position_loss else None,
            "taus": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in taus.items()},
            "prompts_per_category": a.per_category, "max_new_tokens": a.max_new_tokens, "hardware": hw,
            "seconds": round(time.time() - t0, 1)}  # fmt: skip
    for name, run in runs.items():
        info = {"params": params(drafters[name])}
        if run is not None and (run / "metrics.jsonl").is_file():
            recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            tr = [r for r in recs if r["kind"] == "train"]
            ev = [r for r in recs if r["kind"] == "eval"]
            info["train"] = {"steps": tr[-1]["step"] if tr else 0, "final_loss": tr[-1]["loss"] if tr else None,
                             "mean_tokens_per_s": round(sum(r["tokens_per_s"] for r in tr) / max(1, len(tr)), 1),
                             "wall_seconds": round(tr[-1]["time"] - tr[0]["time"], 1) if len(tr) > 1 else None,
                             "last_eval": ev[-1] if ev else None}  # fmt: skip
        card[name] = info
    Path(a.out_json).write_text(json.dumps(card, indent=1))
    print(json.dumps(card["taus"], indent=1))


if __name__ == "__main__":
    main()
