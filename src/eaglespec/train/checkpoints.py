"""A run's checkpoints: checkpoints/step-NNNNNN/ (the portable drafter in fp32 + train_state.pt with the step,
optimizer state and settings), final/ (the finished drafter in the engine's portable format), and resume.

Each directory is written under a temporary name and renamed, so a killed run leaves only complete ones.
Resume refuses a run whose schedule, data or model settings (FIXED_ON_RESUME) differ from the saved ones.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ..models.checkpoint import drafter_state_dict, load_drafter, save_drafter
from ..models.drafter import Eagle3Drafter
from .config import TrainConfig

# settings that must not change when a run is resumed
FIXED_ON_RESUME = ("data", "states", "depth", "decay", "fc_norm", "norm_output", "draft_vocab_size", "batch_size",
                   "steps", "epochs", "lr", "min_lr_frac", "warmup_steps", "seed", "max_len", "val_fraction",
                   "draft_window", "draft_context", "init_from", "quantize", "quantize_group")


def training_card(cfg: TrainConfig, step: int, vocab_coverage: float) -> dict:
    """What the drafter's config.json records about its training (`eaglespec_training`)."""
    return {"target": str(cfg.target), "quantize": cfg.quantize, "data": str(cfg.data), "depth": cfg.depth,
            "steps": step, "batch_size": cfg.batch_size, "lr": cfg.lr, "vocab_coverage": round(vocab_coverage, 4)}


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of run directory `out`, oldest first."""
    root = out / "checkpoints"
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


def _write_then_rename(final: Path, tmp: Path, write: Callable[[Path], None]) -> Path:
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def save_checkpoint(out: Path, step: int, drafter: Eagle3Drafter, optimizer, cfg: TrainConfig, card: dict) -> Path:
    """checkpoints/step-NNNNNN/; keeps the newest cfg.keep_checkpoints (0: all)."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        save_drafter(drafter, tmp, dtype="fp32", extra_config={"eaglespec_training": card})
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "config": asdict(cfg)}, tmp / "train_state.pt")

    final = _write_then_rename(root / f"step-{step:06d}", root / f".tmp-step-{step:06d}", write)
    for old in list_checkpoints(out)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_final(out: Path, drafter: Eagle3Drafter, dtype: str, card: dict) -> Path:
    """final/: the finished drafter, stored in `dtype`."""
    write = lambda tmp: save_drafter(drafter, tmp, dtype=dtype, extra_config={"eaglespec_training": card})
    return _write_then_rename(out / "final", out / ".tmp-final", write)


def refuse_to_overwrite(out: Path) -> None:
    """A new run (no --resume) must not start in a run directory that already has checkpoints."""
    root = out / "checkpoints"
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{out} already has checkpoints: pass --resume to continue, or use a new --out")


def resume(out: Path, cfg: TrainConfig, drafter: Eagle3Drafter, optimizer, target, device) -> tuple[Path, int]:
    """Load the newest checkpoint's weights and optimizer state into `drafter` and `optimizer`:
    (its path, its step). Refused when a FIXED_ON_RESUME setting differs from the saved run's."""
    ckpts = list_checkpoints(out)
    if not ckpts:
        raise ValueError(f"--resume: {out}/checkpoints has no checkpoint to resume from")
    path = ckpts[-1]
    state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    saved = state["config"]
    changed = [k for k in FIXED_ON_RESUME if saved.get(k) != getattr(cfg, k)]
    if changed:
        diff = ", ".join(f"{k} ({saved.get(k)} -> {getattr(cfg, k)})" for k in changed)
        raise ValueError(f"--resume: {diff} "
                         "differ from the run being resumed; keep them, or start a new --out")  # fmt: skip
    loaded = load_drafter(path, target=target, device=str(device), dtype="fp32")
    drafter.load_state_dict(drafter_state_dict(loaded), strict=False)
    optimizer.load_state_dict(state["optimizer"])
    return path, int(state["step"])
