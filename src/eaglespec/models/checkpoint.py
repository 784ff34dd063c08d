"""Reading and writing model directories: config.json + safetensors (single or sharded).

Untrusted weights are read with safetensors, or `torch.load(weights_only=True)` for legacy .bin files;
never with pickle. Every problem is a CheckpointError that says what to fix.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A model directory is missing, malformed or does not fit its partner model."""


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is not a directory; pass the model directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e}); it needs a 'weight_map'") from None
        files = [path / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing shard files listed in its index: {missing}")
        return files
    single = sorted(path.glob("*.safetensors"))
    if single:
        return single
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise CheckpointError(f"{path} has no weights (model.safetensors, shards with an index, or pytorch_model.bin)")


def load_tensors(path: str | os.PathLike, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (or only `names`), keyed by their stored names. Safetensors files
    are read lazily, so asking for one tensor of a large sharded target reads only that tensor."""
    import pickle

    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), "pt") as handle:
                    part = {k: handle.get_tensor(k) for k in handle.keys() if names is None or k in names}
            else:  # legacy .bin: tensors only, never arbitrary pickled objects
                part = torch.load(f, weights_only=True, map_location="cpu")
                if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                    raise CheckpointError(f"{f} is not a flat state dict of tensors")
                part = {k: v for k, v in part.items() if names is None or k in names}
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"refusing to load {f}: it holds objects other than tensors ({e}); "
                                  "convert it to safetensors with the tool that wrote it") from None
        except (SafetensorError, OSError, RuntimeError, EOFError) as e:
            raise CheckpointError(f"cannot read weights file {f}: {e} (truncated or corrupt?)") from None
        tensors.update(part)
    return tensors


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, filename="model.safetensors"):
    """Write tensors atomically (temporary file, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path / filename)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(obj: dict, file: str | os.PathLike) -> None:
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, file)


DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return DTYPES[name]


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
        from .quantize import hold_scales

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
