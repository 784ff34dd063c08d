"""Model directories in and out: Llama-family targets loaded (plain, saved by `eaglespec quantize`, or in
compressed-tensors' layout), EAGLE-3 drafters loaded and saved. Every load is checked against its
config (missing, extra or mis-shaped tensors), and a drafter against its target. The files themselves
are read and written by models/io.py.

Drafters on disk: bare keys (`midlayer.*`, `fc.weight`, ...) and config dialect A
(models/drafter_config.py), so drafters published for vLLM/SGLang load here and ours load there; the
speculators dialect B and `layers.0.*` / `model.*` key prefixes are read too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .compressed import to_eaglespec_layout
from .drafter import Eagle3Drafter
from .drafter_config import DrafterConfig
from .io import CheckpointError, load_tensors, parse_dtype, read_config, save_tensors, write_json
from .layers import rope_tables
from .llama import SUPPORTED_FAMILIES, LlamaTarget, TargetConfig
from .quantize import quantized_shells
from .quantized_linear import hold_scales


def load_target(path, *, device="cpu", dtype="fp32", aux_layers=None):
    """Load a Llama-family HF directory as a LlamaTarget (validated: missing/extra/mis-shaped tensors)."""
    from transformers import AutoConfig

    raw = read_config(path)
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        archs = raw.get("architectures")
        raise CheckpointError(
            f"{path}: unsupported target architecture (model_type={family!r}, architectures={archs}); "
            f"supported model types: {', '.join(SUPPORTED_FAMILIES)}"
        )
    hf = AutoConfig.from_pretrained(str(path))
    cfg = TargetConfig.from_hf(hf)
    with torch.device("meta"):
        model = LlamaTarget(cfg, hf, aux_layers=aux_layers)
    quantized = "quantization_config" in raw
    tensors = load_tensors(path)
    if quantized:  # written by `eaglespec quantize` (models/quantize.py) or in compressed-tensors' layout
        qcfg = raw["quantization_config"]
        if isinstance(qcfg, dict) and qcfg.get("quant_method") == "compressed-tensors":
            qcfg = to_eaglespec_layout(tensors, qcfg, str(path))
        quantized_shells(model, qcfg, str(path))
    _assign(model, tensors, str(path), optional={"lm_head.weight"} if cfg.tie_word_embeddings else set())
    model.rotary = type(model.rotary)(*rope_tables(hf))
    model.to(device=device, dtype=parse_dtype(dtype))
    if quantized:
        hold_scales(model)
    model.eval().requires_grad_(False)
    return model


def _assign(model: torch.nn.Module, tensors: dict, where: str, optional: set[str] = frozenset(), ignore=()):
    """Copy tensors into a (meta) module with clear errors for missing, extra or mis-shaped entries."""
    expected = dict(model.named_parameters(remove_duplicate=False))
    expected.update(dict(model.named_buffers()))
    expected = {k: v for k, v in expected.items() if not k.startswith("rotary.")}
    names = set(tensors) - {k for k in tensors if any(k.startswith(p) or k == p for p in ignore)}
    missing = sorted(set(expected) - names - set(optional))
    extra = sorted(names - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise CheckpointError(f"{where}: unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    bad = [
        f"{k}: file {tuple(tensors[k].shape)} vs config {tuple(p.shape)}"
        for k, p in expected.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(p.shape)
    ]
    if bad:
        raise CheckpointError(f"{where}: tensor shapes do not match config.json: {bad[:4]}")
    loaded = {k: v for k, v in tensors.items() if k in expected}
    model.load_state_dict(loaded, strict=False, assign=True)
    # tied weights: re-tie after assign replaced the embedding parameter
    if getattr(model, "cfg", None) is not None and getattr(model.cfg, "tie_word_embeddings", False):
        if hasattr(model, "lm_head") and hasattr(model, "model"):
            model.lm_head.weight = model.model.embed_tokens.weight


# -- drafters ----------------------------------------------------------------------------------------
def drafter_state_dict(model: Eagle3Drafter, include_embedding: bool = False) -> dict[str, torch.Tensor]:
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("_target_embed")}
    if not include_embedding:
        sd.pop("embed_tokens.weight", None)
    sd["d2t"] = model.d2t.to(torch.long)
    sd["t2d"] = model.t2d.to(torch.bool)
    return sd


def save_drafter(model: Eagle3Drafter, path, *, dtype: str | torch.dtype = "bf16", include_embedding=False,
                 extra_config: dict | None = None) -> None:  # fmt: skip
    """Write config.json (dialect A) + model.safetensors with bare keys (`midlayer.*`, `fc.weight`, ...)."""
    dt = parse_dtype(dtype)
    tensors = {
        k: (v.to(dt) if v.is_floating_point() else v) for k, v in drafter_state_dict(model, include_embedding).items()
    }
    cfg = model.cfg.to_dict()
    cfg["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dt, "float32")
    cfg.update(extra_config or {})
    save_tensors(tensors, path)
    write_json(cfg, Path(path) / "config.json")


def load_drafter(path, *, target=None, device="cpu", dtype="fp32") -> Eagle3Drafter:
    """Load and validate a drafter directory. With `target` (a LlamaTarget), check that they fit."""
    raw = read_config(path)
    cfg = DrafterConfig.from_dict(raw)
    tensors = load_tensors(path)
    if "midlayer.input_layernorm.weight" not in tensors and "layers.0.input_layernorm.weight" in tensors:
        tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items()}
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}  # NeMo/SGLang-style prefix
    if "fc_norm.0.weight" in tensors and not cfg.fc_norm:
        raise CheckpointError(f"{path}: has fc_norm.* tensors but config.json does not set fc_norm: true")
    model = Eagle3Drafter(cfg, own_embedding="embed_tokens.weight" in tensors)
    if "d2t" not in tensors and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size but no d2t tensor")
    tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    if "t2d" not in tensors:  # derive from d2t (engines ignore t2d at inference)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    _assign(model, tensors, str(path), ignore=("mask_hidden",))
    model.d2t = model.d2t.long()
    model.t2d = model.t2d.bool()
    _check_vocab_mapping(model, str(path))
    model.to(device=device, dtype=parse_dtype(dtype))
    model.d2t, model.t2d = model.d2t.long(), model.t2d.bool()
    if target is not None:
        check_pair(model, target, str(path))
    return model.eval().requires_grad_(False)


def _check_vocab_mapping(model: Eagle3Drafter, where: str) -> None:
    ids = model.draft_to_target
    if ids.numel() and (ids.min() < 0 or ids.max() >= model.cfg.vocab_size):
        raise CheckpointError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {model.cfg.vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError(f"{where}: d2t maps several draft ids to the same target id")
    if int(model.t2d.sum()) != model.cfg.draft_vocab_size:
        raise CheckpointError(f"{where}: t2d has {int(model.t2d.sum())} entries set, expected draft_vocab_size")


def check_pair(drafter: Eagle3Drafter, target, where: str = "drafter") -> None:
    """Raise CheckpointError unless the drafter fits the target (widths, vocabulary, aux layers)."""
    c, t = drafter.cfg, target.cfg
    problems = []
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
    if c.target_width != t.hidden_size:
        problems.append(
            f"drafter expects target hidden size {c.target_width} but the target has {t.hidden_size} "
            "(set target_hidden_size, or train a drafter for this target)"
        )
    if drafter.embed_tokens is None and c.hidden_size != t.hidden_size:
        problems.append("drafter hidden_size differs from the target's and it ships no embed_tokens.weight")
    n_aux = len(c.aux_layer_ids) if c.aux_layer_ids else 3
    if c.num_aux_hidden_states != n_aux:
        problems.append(f"num_aux_hidden_states {c.num_aux_hidden_states} != number of aux layer ids {n_aux}")
    if c.aux_layer_ids and any(not 0 <= i < t.num_layers for i in c.aux_layer_ids):
        problems.append(f"aux layer ids {c.aux_layer_ids} outside the target's {t.num_layers} layers")
    if problems:
        raise CheckpointError(f"{where} does not fit the target: " + "; ".join(problems))
