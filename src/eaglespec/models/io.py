"""Files of a model directory: config.json, tensors (safetensors, single or sharded, or legacy .bin),
dtype names, and CheckpointError. The bottom of models/: it imports nothing else from the package.

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
