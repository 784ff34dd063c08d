"""The shipped prompt suites (suites/*.jsonl, built from the corpus test split by scripts/bench/build_suites.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .api import parse_inputs

SUITES_DIR = Path(__file__).resolve().parent / "suites"
CATEGORIES = ("chat", "code", "docs_qa", "summarization", "long_context", "template_perturbed")


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]
    answer: str | None = None  # what a correct reply contains (the context sweep's needle prompts)


def parse_choices(text: str | None, choices, what: str) -> list[str]:
    """'a,b' -> ['a', 'b'] checked against `choices`; None or 'all' -> every choice."""
    if text is None or text == "all":
        return list(choices)
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in choices]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad or text!r}; choose from {', '.join(choices)} (or 'all')")
    return names


def parse_categories(text: str | None) -> list[str]:
    return parse_choices(text, CATEGORIES, "categories")


def load_suite(category: str, limit: int | None = None, suites_dir: Path = SUITES_DIR) -> list[dict]:
    """The first `limit` items of one suite, as stored."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; choose from {', '.join(CATEGORIES)}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    path = Path(suites_dir) / f"{category}.jsonl"
    if not path.is_file():
        raise ValueError(f"suite file {path} is missing; rebuild with scripts/bench/build_suites.py")
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return items[:limit] if limit is not None else items


def tokenize_suite(items: list[dict], category: str, tokenizer) -> list[Prompt]:
    """Chat items go through the target's own chat template; pre-rendered prompts are encoded as text."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; the benchmark suites need one (tokenizer.json)")
    inputs = [{"messages": it["messages"]} if "messages" in it else {"prompt": it["prompt"]} for it in items]
    ids = parse_inputs(inputs, tokenizer, where=f"suite {category}")
    return [Prompt(it["id"], category, p) for it, p in zip(items, ids)]


def load_prompts(categories: list[str], tokenizer, *, limit: int | None, max_new_tokens: int,
                 max_length: int) -> tuple[dict[str, list[Prompt]], list[dict]]:  # fmt: skip
    """Tokenized prompts per category; prompts that do not fit the context with max_new_tokens are skipped."""
    prompts, skipped = {}, []
    for cat in categories:
        kept = []
        for p in tokenize_suite(load_suite(cat, limit), cat, tokenizer):
            if len(p.ids) + max_new_tokens > max_length:
                skipped.append({"id": p.id, "prompt_tokens": len(p.ids), "reason": f"exceeds context {max_length}"})
            else:
                kept.append(p)
        if kept:
            prompts[cat] = kept
    if not prompts:
        raise ValueError("no prompt fits the target's context; lower --max-new-tokens or choose other categories")
    return prompts, skipped


def context_prompts(tokenizer, lengths, per_length: int = 1, suites_dir: Path = SUITES_DIR) -> dict[int, list[Prompt]]:
    """The context sweep's prompts (suites/context.jsonl: long held-out texts). For each length L and each
    of the first `per_length` texts: the text's first L tokens (to continue), and a needle prompt of L
    tokens: the text with a sentence holding a number inserted at half depth and a question about it at the
    end (retrieval). Lengths longer than a text are skipped for that text."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; the context sweep needs one (tokenizer.json)")
    path = Path(suites_dir) / "context.jsonl"
    if not path.is_file():
        raise ValueError(f"suite file {path} is missing; rebuild with scripts/bench/build_suites.py")
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:per_length]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False, verbose=False)  # longer than the context
    out: dict[int, list[Prompt]] = {}
    for item in items:
        ids, needle, question = encode(item["text"]), encode(" " + item["needle"] + " "), encode(item["question"])
        for n in lengths:
            body = n - len(needle) - len(question)
            if n > len(ids) or body < 2:
                continue
            half = body // 2
            out.setdefault(n, []).append(Prompt(f"{item['id']}@{n}", "text", ids[:n]))
            retrieval = ids[:half] + needle + ids[half:body] + question
            out[n].append(Prompt(f"{item['id']}@{n}/needle", "needle", retrieval, answer=item["answer"]))
    return out
