"""Loading model directories as models: Llama-family targets (plain, saved by `eaglespec quantize`, or in
compressed-tensors' layout), validated against their config. The files themselves are read by models/io.py.
"""

from __future__ import annotations

import torch

from .io import CheckpointError, load_tensors, parse_dtype, read_config


def load_target(path, *, device="cpu", dtype="fp32", aux_layers=None):
    """Load a Llama-family HF directory as a LlamaTarget (validated: missing/extra/mis-shaped tensors)."""
    from transformers import AutoConfig

    from .llama import SUPPORTED_FAMILIES, LlamaTarget, TargetConfig

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
        from .quantize import quantized_shells

        qcfg = raw["quantization_config"]
        if isinstance(qcfg, dict) and qcfg.get("quant_method") == "compressed-tensors":
            from .compressed import to_eaglespec_layout

            qcfg = to_eaglespec_layout(tensors, qcfg, str(path))
        quantized_shells(model, qcfg, str(path))
    _assign(model, tensors, str(path), optional={"lm_head.weight"} if cfg.tie_word_embeddings else set())
    model.rotary = type(model.rotary)(*_rope(hf))
    model.to(device=device, dtype=parse_dtype(dtype))
    if quantized:
        from .quantized_linear import hold_scales

        hold_scales(model)
    model.eval().requires_grad_(False)
    return model


def _rope(hf):
    from .layers import rope_tables

    return rope_tables(hf)


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
