"""The training schedule: the learning rate at each step (warm-up, then cosine), the held-out split, and
each epoch's batch order (deterministic in seed and epoch, so a resumed run replays it)."""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    prog = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_frac
    return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * prog))


def split_validation(n: int, fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic held-out split by sample index: every k-th sample is held out."""
    if fraction <= 0:
        return list(range(n)), []
    k = max(2, round(1 / fraction))
    val = list(range(0, n, k))
    held = set(val)
    return [i for i in range(n) if i not in held], val


def epoch_batches(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """The optimizer batches of one epoch (indices into the training samples): a seeded permutation,
    cut into groups of 16 batches whose samples are sorted by length before being split into batches
    (less padding), then the batches are shuffled. Deterministic in (seed, epoch), so resume replays it."""
    g = torch.Generator().manual_seed(cfg.seed * 1000003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    per_epoch = len(lengths) // cfg.batch_size
    perm = perm[: per_epoch * cfg.batch_size]
    group = 16 * cfg.batch_size
    batches = []
    for i in range(0, len(perm), group):
        chunk = sorted(perm[i : i + group], key=lambda j: lengths[j])
        batches += [chunk[k : k + cfg.batch_size] for k in range(0, len(chunk), cfg.batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[o] for o in order]
