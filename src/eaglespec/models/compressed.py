"""Reading compressed-tensors checkpoints (the quantized layout vLLM loads and llm-compressor writes)
into the QuantizedLinear layout of models/quantized_linear.py, with the `compressed-tensors` library's own
unpacking. Read: weight-only, symmetric

  pack-quantized   int4 in groups of 32/64/128/256 (W4A16), or int8 per output channel
  int-quantized / naive-quantized   int8 per output channel (W8A16)
  int-quantized with dynamic per-token symmetric int8 input activations (W8A8, llm-compressor's
  W8A8 int8 scheme): run as `--quantize w8a8` does (activation scale = row amax / 127, as vLLM's
  scaled_int8_quant computes it)

with one config group covering the decoder layers' linears (lm_head and embeddings unquantized).
Anything else (static or per-tensor activation scales, asymmetric, fp8/fp4 formats) is refused with
what is read.
Scales are held in bf16 as ours are: a checkpoint whose scales are stored wider is rounded to bf16.
"""

from __future__ import annotations

import torch

from .io import CheckpointError
from .quantize import QUANT_METHOD
from .quantized_linear import HELD_DTYPE, INT4_GROUPS

METHOD = "compressed-tensors"
READ = ("pack-quantized (int4 symmetric groups of 32-256, or int8 per channel) and int-quantized / "
        "naive-quantized (int8 symmetric per channel), weights only; int-quantized int8 channel weights with "
        "dynamic per-token symmetric int8 input activations (W8A8)")  # fmt: skip
W8A8_INPUTS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}  # and symmetric


def activation_args(qcfg: dict, where: str) -> str | None:
    """None (weight-only) or "int8" (dynamic per-token int8 inputs) of a supported config, else CheckpointError."""
    group = next(iter((qcfg.get("config_groups") or {"": {}}).values()))
    inputs = group.get("input_activations")
    if group.get("output_activations"):
        raise CheckpointError(f"{where}: output activation quantization is not supported; eaglespec reads {READ}")
    if not inputs:
        return None
    if any(inputs.get(k) != v for k, v in W8A8_INPUTS.items()) or inputs.get("symmetric", True) is not True:
        seen = {k: inputs.get(k) for k in [*W8A8_INPUTS, "symmetric"]}
        raise CheckpointError(f"{where}: input activation quantization {seen} is not supported; eaglespec reads "
                              f"{READ}")  # fmt: skip
    return "int8"


def weight_args(qcfg: dict, where: str) -> tuple[str, int, int | None]:
    """(format, bits, group size or None for per channel) of a supported config, else CheckpointError."""
    fmt = qcfg.get("format")
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{where}: compressed-tensors config with {len(groups)} config groups; eaglespec reads "
                              f"one group covering the decoder layers ({READ})")  # fmt: skip
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    bits, strategy, size = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if w.get("type", "int") != "int" or not w.get("symmetric", True):
        raise CheckpointError(f"{where}: {w.get('type')} {'symmetric' if w.get('symmetric') else 'asymmetric'} "
                              f"weights are not supported; eaglespec reads {READ}")  # fmt: skip
    if fmt == "pack-quantized" and bits == 4 and strategy == "group" and size in INT4_GROUPS:
        return fmt, 4, size
    if fmt in ("pack-quantized", "int-quantized", "naive-quantized") and bits == 8 and strategy == "channel":
        return fmt, 8, None
    raise CheckpointError(f"{where}: compressed-tensors format {fmt!r} with {bits}-bit {strategy} weights "
                          f"(group size {size}) is not supported; eaglespec reads {READ}")  # fmt: skip


def to_eaglespec_layout(tensors: dict[str, torch.Tensor], qcfg: dict, where: str) -> dict:
    """Rewrite a compressed-tensors state dict in place into QuantizedLinear's tensors (codes, scales,
    zeros); returns the matching eaglespec quantization_config."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:
        raise CheckpointError(f"{where}: reading a compressed-tensors checkpoint needs the library: "
                              "pip install compressed-tensors") from None  # fmt: skip
    fmt, bits, group = weight_args(qcfg, where)
    activations = activation_args(qcfg, where)
    if activations and (fmt, bits) != ("int-quantized", 8):
        raise CheckpointError(f"{where}: int8 input activations with {fmt} {bits}-bit weights are not supported; "
                              f"eaglespec reads {READ}")  # fmt: skip
    suffix = ".weight_packed" if fmt == "pack-quantized" else ".weight_scale"
    prefixes = [k[: -len(suffix)] for k in list(tensors) if k.endswith(suffix)]
    if not prefixes:
        raise CheckpointError(f"{where}: no quantized layers found (no '*{suffix}' tensors) for format {fmt!r}")
    for p in prefixes:
        scale = tensors.pop(f"{p}.weight_scale")
        if fmt == "pack-quantized":
            shape = torch.Size(tensors.pop(f"{p}.weight_shape").tolist())
            q = unpack_from_int32(tensors.pop(f"{p}.weight_packed"), bits, shape)  # int8, signed
        else:
            q = tensors.pop(f"{p}.weight")
        tensors.pop(f"{p}.weight_zero_point", None)  # symmetric: zero
        if q.dtype != torch.int8:
            raise CheckpointError(f"{where}: {p}.weight holds {q.dtype}, expected int8 codes")
        if bits == 8:
            tensors[f"{p}.codes"] = q
            tensors[f"{p}.scales"] = scale.reshape(-1).to(HELD_DTYPE)
        else:  # our int4 computes (code - 8) * scale + zero: code = q + 8, zero = 0
            codes = (q.to(torch.int16) + 8).to(torch.uint8)
            tensors[f"{p}.codes"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            tensors[f"{p}.scales"] = scale.to(HELD_DTYPE)
            tensors[f"{p}.zeros"] = torch.zeros_like(scale, dtype=HELD_DTYPE)
    return {"quant_method": QUANT_METHOD, "bits": bits, "group_size": group, "activations": activations,
            "source": METHOD}
