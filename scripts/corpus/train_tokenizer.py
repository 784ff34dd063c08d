#!/usr/bin/env python3
"""Train the eaglespec default tokenizer: byte-level BPE, vocab 8192, on the corpus train split.

Special tokens (ids 0..5, in this order):
    <|endoftext|>  document separator in pretraining (also used as bos_token, never added automatically)
    <|pad|>        padding
    <|system|> <|user|> <|assistant|>   role tags
    <|end|>        end of a message == eos_token

Chat template: each message is rendered as ``<|{role}|>\\n{content}<|end|>\\n``;
``add_generation_prompt=True`` appends ``<|assistant|>\\n``.

Usage::

    python scripts/corpus/train_tokenizer.py [--corpus data/corpus] [--out data/tokenizer]

Deterministic given the corpus (fixed per-part caps, documents in file order).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
VOCAB_SIZE = 8192
# MB of train text taken from each part (first documents of the train split, in file order).
CAP_MB = {"code_stdlib": 10, "code_stdlib_tests": 4, "docs_python_rst": 11, "docs_linux_rst": 4,
          "docs_perl_pod": 2, "ref_gcide": 3, "ref_wordnet": 2, "chat_chitchat": 4, "chat_docstring": 3}
DEFAULT_CAP_MB = 2


def iter_texts(corpus: Path, log=print):
    manifest = json.loads((corpus / "manifest.json").read_text())
    for part, info in manifest["parts"].items():
        cap = CAP_MB.get(part, DEFAULT_CAP_MB) * 1_000_000
        n = 0
        path = corpus / part / "train.jsonl"
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if "messages" in rec:
                    texts = [m["content"] for m in rec["messages"]]
                else:
                    texts = [rec["text"]]
                for t in texts:
                    n += len(t)
                    yield t
                if n >= cap:
                    break
        log(f"  {part:24s} {n / 1e6:6.2f} MB")


def build_hf_tokenizer(tok: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus"))
    ap.add_argument("--out", default=str(ROOT / "data/tokenizer"))
    args = ap.parse_args()
    t0 = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_texts(Path(args.corpus)), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    hf = build_hf_tokenizer(tok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    print(f"trained vocab={tok.get_vocab_size()} in {time.time() - t0:.1f}s -> {out}")

    # quick check through AutoTokenizer
    from transformers import AutoTokenizer

    at = AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "def add(a, b):"}]
    text = at.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = at.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert text == "<|system|>\nYou are helpful.<|end|>\n<|user|>\ndef add(a, b):<|end|>\n<|assistant|>\n", repr(text)
    assert at.decode(ids) == text, (at.decode(ids), text)
    assert at.eos_token == "<|end|>" and at.pad_token == "<|pad|>"
    assert at.convert_tokens_to_ids("<|end|>") == 5 and ids[0] == 2 and ids[-2] == 4
    assert at("hello world")["input_ids"] == tok.encode("hello world").ids  # no BOS added
    print("chat template check ok:", repr(text), ids)


if __name__ == "__main__":
    main()
