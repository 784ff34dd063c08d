"""Drafters out to other engines' layouts, and the serving commands that go with them.

One file per format, each a writer over the same validated source (a drafter read by models/checkpoint.py,
which reads every layout we know: dialect A with or without `eagle_config` nesting, speculators, the
EAGLE reference's pytorch_model.bin, `layers.0.*` / `model.*` key prefixes):
- eagle3.py: dialect A (vLLM, SGLang, SpecForge, EAGLE), every optional key written explicitly;
- speculators.py: vLLM's speculators layout (`Eagle3DraftModel` config, `layers.0.*` keys);
- gguf.py: target and EAGLE-3 drafter for llama.cpp, with the `gguf` package;
- commands.py: the serve commands for vLLM, SGLang and llama.cpp.
Nothing here runs a model: tensors are copied (cast only when asked), so every round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.checkpoint import check_pair, drafter_state_dict, load_drafter
from ..models.drafter import Eagle3Drafter
from ..models.drafter_config import DrafterConfig
from ..models.io import CheckpointError, parse_dtype, read_config

FORMATS = ("eagle3", "speculators", "gguf")


@dataclass
class TargetInfo:
    """What an export needs of the target: its config, never its weights (those are read by name)."""

    path: Path
    raw: dict  # config.json as stored
    cfg: object  # models.llama.TargetConfig

    @classmethod
    def read(cls, path) -> TargetInfo:
        from transformers import AutoConfig

        from ..models.llama import TargetConfig

        path = Path(path)
        raw = read_config(path)
        try:
            cfg = TargetConfig.from_hf(AutoConfig.from_pretrained(str(path)))
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        return cls(path, raw, cfg)


@dataclass
class Source:
    """A validated drafter with the target it was checked against."""

    path: Path
    drafter: Eagle3Drafter
    target: TargetInfo
    stored_dtype: torch.dtype  # the drafter's floating dtype on disk (kept unless the export casts)
    own_embedding: bool  # ships an embedding that differs from the target's (else engines share the target's)

    @property
    def cfg(self) -> DrafterConfig:
        return self.drafter.cfg

    @property
    def aux_layer_ids(self) -> list[int]:
        """Capture-before-layer ids (vLLM's convention): the drafter's own, else the target's defaults."""
        return list(self.cfg.aux_layer_ids or self.target.cfg.default_aux_layers())

    def tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Dialect-A names (`midlayer.*`, `fc.weight`, `d2t`, ...) in `dtype` (default: as stored)."""
        dt = dtype or self.stored_dtype
        sd = drafter_state_dict(self.drafter, include_embedding=self.own_embedding)
        return {k: (v.to(dt) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def open_source(drafter_dir, target_dir) -> Source:
    """Load and validate a drafter of any known layout against the target's config."""
    from ..models.io import load_tensors

    target = TargetInfo.read(target_dir)
    fc = list(load_tensors(drafter_dir, names={"fc.weight", "model.fc.weight"}).values())
    stored_dtype = fc[0].dtype if fc and fc[0].is_floating_point() else torch.float32
    drafter = load_drafter(drafter_dir, dtype=stored_dtype)  # no upcast: every copy is bit-exact
    check_pair(drafter, target, str(drafter_dir))
    own = drafter.embed_tokens is not None
    if own and drafter.cfg.hidden_size == target.cfg.hidden_size:  # speculators ships a copy of the target's
        from .speculators import target_embedding

        embed = target_embedding(target.path).to(stored_dtype)
        own = embed.shape != drafter.embed_tokens.weight.shape or not torch.equal(drafter.embed_tokens.weight, embed)
    return Source(Path(drafter_dir), drafter, target, stored_dtype, own)


def check_format(src: Source, fmt: str) -> None:
    """Raise (with the reason and what to do instead) when `fmt` cannot hold this drafter."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt == "gguf":
        from .gguf import check_drafter

        check_drafter(src.cfg)
    if fmt == "speculators" and src.cfg.fc_bias:
        raise CheckpointError(f"{src.path}: the drafter has a bias on fc, which the speculators format cannot hold "
                              "(its fc has none); export it as --format eagle3 (SGLang reads `bias`)")  # fmt: skip


def export_drafter(drafter_dir, fmt: str, out, *, target_dir, dtype: str | None = None, **options) -> list[Path]:
    """Write the drafter (and, for gguf, the target) in `fmt` under `out`. Returns the files written."""
    src = open_source(drafter_dir, target_dir)
    check_format(src, fmt)
    out = Path(out)
    if out.resolve() == Path(drafter_dir).resolve():
        raise ValueError(f"--out {out} is the drafter's own directory; choose a new one")
    if fmt == "gguf":
        from .gguf import write_gguf_pair

        outtype = options.get("outtype") or "f32"
        return write_gguf_pair(src, out, outtype=outtype, target_gguf=options.get("target_gguf"))
    dt = parse_dtype(dtype) if dtype else None
    if fmt == "eagle3":
        from .eagle3 import write_eagle3

        return write_eagle3(src, out, dt)
    from .speculators import write_speculators

    return write_speculators(src, out, dt, verifier=options.get("verifier"),
                             speculative_tokens=options.get("speculative_tokens") or 3)  # fmt: skip


def engine_ignored_keys(cfg: DrafterConfig, fmt: str = "eagle3") -> list[str]:
    """What other engines will not honour for this drafter (they run it without, or cannot load it)."""
    notes = []
    if fmt == "speculators" and cfg.target_width != cfg.hidden_size:
        notes.append(f"target_hidden_size {cfg.target_width} != hidden_size {cfg.hidden_size}: vLLM reads it, "
                     "but speculators' own Eagle3DraftModel (0.9) sizes fc by the draft width and cannot "
                     "load it")
    if cfg.draft_attention_window:
        notes.append(f"draft_attention_window={cfg.draft_attention_window}: other engines run the drafter's "
                     "attention over the whole context (acceptance on long prompts may be lower there)")  # fmt: skip
    return notes


__all__ = ["FORMATS", "Source", "TargetInfo", "check_format", "engine_ignored_keys", "export_drafter", "open_source"]
