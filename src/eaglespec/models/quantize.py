"""Quantization schemes of a target's decoder linears (`--quantize int8|int4|w8a8`), applied at load time
or saved with the target.

`quantize_target` / `apply_quantize` replace the linears of a loaded target; `save_quantized` writes a
quantized target as a model directory, and `quantized_shells` prepares its layers when one is read back
(models/checkpoint.py). The layer and its layouts: models/quantized_linear.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from .io import CheckpointError, parse_dtype, save_tensors, write_json
from .quantized_linear import DEFAULT_GROUP, QuantizedLinear

SCHEMES = {"int8": (8, None), "int4": (4, None), "w8a8": (8, "int8")}  # --quantize name -> (bits, activations)


def parse_quantize(text: str | None) -> tuple[int, str | None] | None:
    """'int8' / 'int4' / 'w8a8' -> (weight bits, activations); None or 'none' -> None."""
    if text in (None, "none"):
        return None
    scheme = SCHEMES.get(text)
    if scheme is None:
        raise ValueError(f"--quantize must be one of {', '.join(SCHEMES)} or none, got {text!r}")
    return scheme


def quantization_info(bits: int, group: int, activations: str | None) -> dict:
    """What `model.quantization` holds (and reports) for a scheme."""
    return {"bits": bits, "group": group if bits == 4 else None, "activations": activations}


def quantize_target(target: nn.Module, bits: int, group: int = DEFAULT_GROUP,
                    activations: str | None = None) -> nn.Module:  # fmt: skip
    """Replace the linear layers of every decoder layer (attention and MLP) by QuantizedLinear, in
    place. Embeddings and lm_head stay in the loaded precision (the drafter shares the embedding)."""
    if group < 1:
        raise ValueError(f"--quantize-group must be >= 1, got {group}")
    if getattr(target, "quantization", None) is not None:
        raise ValueError("this target is already quantized (a saved `eaglespec quantize` directory): "
                         "load it without --quantize")  # fmt: skip
    _replace_decoder_linears(target, lambda linear: QuantizedLinear.from_linear(linear, bits, group, activations))
    target.quantization = quantization_info(bits, group, activations)
    return target


def apply_quantize(target: nn.Module, name: str | None, group: int | None = None) -> nn.Module:
    """`--quantize NAME [--quantize-group G]` on a loaded target (no-op for None / 'none')."""
    scheme = parse_quantize(name)
    if scheme is not None:
        quantize_target(target, scheme[0], DEFAULT_GROUP if group is None else group, scheme[1])
    return target


def scheme_name(quantization: dict) -> str:
    """'int8', 'w8a8' or 'int4 g128' for a model's `quantization`."""
    if quantization.get("activations"):
        return "w8a8"
    return f"int{quantization['bits']}" + (f" g{quantization['group']}" if quantization["bits"] == 4 else "")


def _replace_decoder_linears(model: nn.Module, make) -> None:
    """Every nn.Linear of the decoder layers' attention and MLP -> make(linear), in place; matmuls fused
    from them earlier (models/fast_linear.py) read the old weights and are dropped."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child))
            for fused in ("_qkv", "_gate_up"):
                if hasattr(parent, fused):
                    delattr(parent, fused)


# -- saved quantized targets ---------------------------------------------------------------------------
QUANT_METHOD = "eaglespec"  # quantization_config.quant_method of directories written by `eaglespec quantize`
WEIGHT_FILES = (".safetensors", ".bin")
NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def save_quantized(target: nn.Module, source_dir, out_dir) -> Path:
    """Write a quantized target as an HF-style directory that loads without re-quantizing: config.json
    with a `quantization_config`, model.safetensors (codes/scales/zeros per quantized layer, the other
    tensors as loaded), and the source's tokenizer and generation files."""
    q = getattr(target, "quantization", None)
    if q is None:
        raise ValueError("the target is not quantized: call quantize_target first")
    source, out = Path(source_dir), Path(out_dir)
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the source directory; choose another folder")

    config = json.loads((source / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("rotary.")}
    if target.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, saved once
    held = {id(t) for m in target.modules() if isinstance(m, QuantizedLinear) for t in (m.scales, m.zeros)}
    state = {k: v.to(parse_dtype(stored)) if v.is_floating_point() and id(v) not in held else v
             for k, v in state.items()}  # unquantized tensors in the source's precision  # fmt: skip
    save_tensors(state, out)
    for f in source.iterdir():
        if f.is_file() and f.suffix not in WEIGHT_FILES and f.name not in NOT_COPIED:
            shutil.copyfile(f, out / f.name)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "bits": q["bits"], "group_size": q["group"],
                                     "activations": q.get("activations"),
                                     "modules": "decoder layers: self_attn and mlp linears"}  # fmt: skip
    write_json(config, out / "config.json")
    return out


def quantized_shells(model: nn.Module, qcfg: dict, where: str) -> None:
    """Before loading a saved quantized target: replace the decoder layers' linears of a (meta) model
    by empty QuantizedLinear of the saved layout, so the checkpoint's tensors are checked against it."""
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != QUANT_METHOD:
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not supported; eaglespec "
                              f"reads the layout `eaglespec quantize` writes ({QUANT_METHOD!r}) and "
                              "compressed-tensors (models/compressed.py), or quantizes an unquantized model at "
                              "load with --quantize")  # fmt: skip
    bits, group = qcfg.get("bits"), qcfg.get("group_size") or DEFAULT_GROUP
    activations = qcfg.get("activations")
    try:
        _replace_decoder_linears(model, lambda linear: QuantizedLinear(
            linear.in_features, linear.out_features, bits, group, bias=linear.bias is not None, device="meta",
            activations=activations))  # fmt: skip
    except ValueError as e:
        raise CheckpointError(f"{where}: bad quantization_config ({e})") from None
    model.quantization = quantization_info(bits, group, activations)
