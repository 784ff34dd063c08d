"""GGUF targets: a `.gguf` file wherever a target folder is accepted, converted once to a plain HF folder.

The file is read with the `gguf` package (metadata checks) and dequantized by `transformers`' GGUF
integration to fp32 (the values the quantized weights stand for; a lower precision is chosen at load,
as for any folder); the tokenizer and chat template come from the file. The folder is cached under
machine.cache_dir()/gguf/, keyed by the file's content hash (remembered per path, size and mtime, so a
second start neither converts nor hashes). A conversion is written to a `.partial-<pid>` folder and
renamed when complete: an interrupted one is never used, and the next start removes it and redoes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..machine import cache_dir, read_cached, write_cached
from .io import CheckpointError

# GGUF `general.architecture` values of the families models/llama.py runs (Mistral's GGUFs say "llama")
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
HASH_CACHE = "gguf_hashes.json"  # path|size|mtime -> content hash, in machine.cache_dir()


def is_gguf(path) -> bool:
    return str(path).lower().endswith(".gguf")


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    try:
        return bytes(value).decode()
    except (TypeError, ValueError):
        return value


def check_gguf(path: Path) -> str:
    """Read the file's metadata; returns its architecture. CheckpointError with what to fix for a missing,
    truncated or corrupt file, an architecture we do not run, or a file without a tokenizer."""
    import gguf

    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails in numpy (reshape, memmap) on cut or damaged files
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt: {e}); download or "
                              "copy it again") from None  # fmt: skip
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; eaglespec runs "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3)")  # fmt: skip
    if _field(reader, "tokenizer.ggml.model") is None or reader.fields.get("tokenizer.ggml.tokens") is None:
        raise CheckpointError(f"{path} has no tokenizer (no tokenizer.ggml.* keys); use a GGUF written with its "
                              "tokenizer, e.g. by llama.cpp's convert_hf_to_gguf.py")  # fmt: skip
    return arch


def content_hash(path: Path) -> str:
    """sha256 of the file (first 16 hex digits), remembered per path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    hit = read_cached(HASH_CACHE).get(key)
    if isinstance(hit, str):
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    digest = h.hexdigest()[:16]
    write_cached(HASH_CACHE, key, digest)
    return digest


def gguf_folder(path, *, log=None) -> Path:
    """The HF folder (config.json, model.safetensors, tokenizer) of a GGUF target, converting it the
    first time. log(msg): told when a conversion runs."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    folder = cache_dir() / "gguf" / f"{path.stem}-{content_hash(path)}"
    if (folder / "config.json").is_file():  # converted before: neither read nor checked again
        _remember_source(folder, path)
        return folder
    arch = check_gguf(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f"{folder.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)  # an interrupted conversion: redone below
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    if log is not None:
        log(f"converting {path.name} ({arch}) to an HF folder once: {folder}")
    try:
        _convert(path, partial)
        os.replace(partial, folder)
        _remember_source(folder, path)
    except OSError:
        if not (folder / "config.json").is_file():  # not a concurrent conversion that finished first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


SOURCE_FILE = "source_gguf.txt"  # in a converted folder: the path of the GGUF it was last reached from


def _remember_source(folder: Path, path: Path) -> None:
    where = str(path.resolve())
    record = folder / SOURCE_FILE
    if not record.is_file() or record.read_text() != where:
        tmp = record.with_name(f"{SOURCE_FILE}.{os.getpid()}")
        tmp.write_text(where)
        os.replace(tmp, record)


def source_gguf(folder) -> Path | None:
    """The GGUF file a converted folder came from, if it is still there with the same contents (a runtime
    that reads GGUF itself, models/llamacpp/, runs that file); None for any other folder."""
    record = Path(folder) / SOURCE_FILE
    if not record.is_file():
        return None
    path = Path(record.read_text())
    if not path.is_file() or cache_dir() / "gguf" / f"{path.stem}-{content_hash(path)}" != Path(folder):
        return None
    return path


def as_model_folder(path, *, log=None):
    """A target as a folder: a GGUF file's converted folder, anything else as given."""
    return gguf_folder(path, log=log) if path is not None and is_gguf(path) else path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as e:
        raise CheckpointError(f"reading GGUF needs transformers' GGUF support: {e}") from None
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: transformers could not load this GGUF ({e})") from None
    # the weights are plain fp32 tensors now: save them as an unquantized model
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config["eaglespec_source"] = {"gguf": path.name, "dequantized_to": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
