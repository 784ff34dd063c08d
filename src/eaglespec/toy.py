"""Tiny random models with a real tokenizer, for trying the tools before real models exist.

The weights are random: outputs are gibberish and acceptance is near 1. They exercise the plumbing
(loading, chat templates, streaming, statistics), not speed or quality.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("[a-c]*.py"))[:40]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_toy_models(out, *, seed: int = 0, vocab_size: int = 1024) -> tuple[Path, Path]:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from .models.checkpoint import load_target, save_drafter
    from .models.drafter import Eagle3Drafter
    from .models.drafter_config import new_drafter_config

    out = Path(out)
    tokenizer = _train_tokenizer(vocab_size)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
        initializer_range=0.1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    target_dir = out / "target"
    model.save_pretrained(str(target_dir))
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(target_dir)
    )
    tokenizer.save_pretrained(str(target_dir))
    target = load_target(target_dir)
    drafter = Eagle3Drafter(new_drafter_config(target.cfg, fc_norm=True, norm_output=True))
    draft_dir = out / "drafter-eagle3.1"
    save_drafter(drafter, draft_dir, dtype="fp32")
    return target_dir, draft_dir
