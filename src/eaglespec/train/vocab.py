"""`eaglespec data vocab`: the draft vocabulary (d2t / t2d) from assistant-token frequencies.

Count target ids where loss_mask == 1, keep the Vd most frequent (ties broken by the
smaller id, padded with the smallest unseen ids when fewer than Vd distinct tokens occur), sort them
ascending; d2t[i] = used[i] - i and t2d[j] = j in used. A target token outside the draft vocabulary
still works at inference (it is embedded from the full target table and verified normally: the drafter
just cannot propose it); training masks positions whose target argmax is outside it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .shards import Sample, write_json_atomic


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s.input_ids[s.loss_mask]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def choose_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids (stable: equal counts keep the smaller id), sorted ascending."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def mapping(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = used - torch.arange(used.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def coverage_report(counts: torch.Tensor, used: torch.Tensor) -> dict:
    total = int(counts.sum())
    inside = int(counts[used].sum())
    seen = int((counts > 0).sum())
    return {
        "draft_vocab_size": int(used.numel()),
        "target_vocab_size": int(counts.numel()),
        "assistant_tokens": total,
        "distinct_assistant_tokens": seen,
        "coverage": inside / total if total else 0.0,  # share of assistant tokens the drafter can emit
        "tokens_outside": total - inside,
        "distinct_outside": int(((counts > 0) & ~torch.isin(torch.arange(counts.numel()), used)).sum()),
    }


def save_vocab(path, used: torch.Tensor, vocab_size: int, report: dict) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    d2t, t2d = mapping(used, vocab_size)
    save_file({"d2t": d2t, "t2d": t2d}, str(path / "vocab.safetensors"))
    write_json_atomic(report, path / "vocab_report.json")


def load_vocab(path, vocab_size: int) -> torch.Tensor:
    """The sorted target ids of a saved draft vocabulary (validated)."""
    from safetensors.torch import load_file

    from .shards import DataError

    file = Path(path) / "vocab.safetensors"
    if not file.is_file():
        raise DataError(f"{path} has no vocab.safetensors; create it with `eaglespec data vocab`")
    t = load_file(str(file))
    if "d2t" not in t or "t2d" not in t:
        raise DataError(f"{file} needs tensors d2t and t2d")
    used = torch.arange(t["d2t"].numel()) + t["d2t"].long()
    if t["t2d"].numel() != vocab_size:
        raise DataError(f"{file} was made for a vocabulary of {t['t2d'].numel()} tokens; the target has {vocab_size}")
    if not torch.equal(t["t2d"].nonzero().flatten(), used):
        raise DataError(f"{file}: d2t and t2d disagree")
    return used
