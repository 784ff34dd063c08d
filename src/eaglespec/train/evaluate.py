"""Held-out evaluation of the drafter being trained: TTT loss and accuracy per TTT step on held-out samples,
and real tau: the engine generates greedily from held-out prompts with the drafter, through the same path
and stop rules as `eaglespec generate` (api.generate: the EOS ids of api.stop_ids_for)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..api import generate
from ..engine import Engine
from ..models.drafter import Eagle3Drafter
from ..sampling import SamplingParams
from .config import TrainConfig
from .report import accuracy, merge_stats
from .shards import Sample
from .ttt import ttt_loss


def held_out_loss(model: torch.nn.Module, features: Callable, val: list[int], cfg: TrainConfig) -> dict:
    """Mean TTT loss per sample and accuracy per TTT step over the held-out samples `val` (indices);
    `features(indices)` gives (batch, aux, targets) as in training."""
    stats, loss = None, 0.0
    for i in range(0, len(val), cfg.micro_batch):
        batch, aux, targets = features(val[i : i + cfg.micro_batch])
        per_sample, s = ttt_loss(model(aux, batch.input_ids), batch, targets, cfg.decay)
        loss += float(per_sample.sum())
        stats = merge_stats(stats, s)
    return {"val_loss": loss / len(val), "val_step_accuracy": accuracy(stats)}


def held_out_prompts(samples: list[Sample], val: list[int], cfg: TrainConfig) -> list[list[int]]:
    """The first cfg.eval_prompts held-out samples, each up to its first assistant token (at most
    cfg.max_len tokens, the last ones)."""
    prompts = []
    for i in val[: cfg.eval_prompts]:
        s = samples[i]
        first = int(s.loss_mask.nonzero()[0]) if s.loss_mask.any() else len(s.input_ids) // 2
        if first >= 1:
            prompts.append(s.input_ids[:first][-cfg.max_len :].tolist())
    return prompts


def real_tau(target, drafter: Eagle3Drafter, prompts: list[list[int]], cfg: TrainConfig, tokenizer=None) -> dict:
    """Mean acceptance length when the engine generates greedily from `prompts` with a copy of `drafter`
    (cfg.eval_mode, cfg.eval_chain_k, cfg.eval_max_new_tokens). A reply ends where `eaglespec generate`
    ends it: at an EOS id of the target's generation config or of `tokenizer` (the target's own, or None)."""
    if not prompts:
        return {}
    engine = Engine(target, copy.deepcopy(drafter).eval(), mode=cfg.eval_mode, chain_k=cfg.eval_chain_k,
                    adaptive=False, tokenizer=tokenizer)  # fmt: skip
    out = generate(engine, prompts, SamplingParams(), max_new_tokens=cfg.eval_max_new_tokens,
                   batch_size=min(8, len(prompts)))  # fmt: skip
    s = out.stats
    return {"tau": s.tau, "acceptance_per_position": s.per_position_acceptance,
            "eval_mode": cfg.eval_mode, "eval_prompts": len(prompts)}  # fmt: skip
