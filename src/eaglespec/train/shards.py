"""Sharded training samples on disk: token ids plus an assistant loss mask per sample.

A data directory holds `manifest.json` and `shard-NNNNN.safetensors` files. Each shard stores the
samples of a fixed range of input lines flattened into `input_ids` (int32) and `loss_mask` (uint8) with
`offsets` (int64, n+1) marking where each sample starts. Shards are written atomically (temporary file,
then rename), so an interrupted run leaves only complete shards and resumes at the first missing one.
safetensors is used for reading: nothing here unpickles data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "manifest.json"


class DataError(ValueError):
    """A data directory is missing, malformed or made for another target."""


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool: 1 where the token is part of an assistant reply


def shard_path(root: Path, index: int) -> Path:
    return root / f"shard-{index:05d}.safetensors"


def write_json_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def write_shard(root: Path, index: int, samples: list[Sample], metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    empty = torch.zeros(0)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32) if samples else empty.int(),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8) if samples else empty.byte(),
        "offsets": offsets,
    }
    path = shard_path(root, index)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata or {})
    os.replace(tmp, path)
    return path


def read_shard(path: Path) -> list[Sample]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable shard ({e}); delete it and rerun `eaglespec data regen`") from None
    need = {"input_ids", "loss_mask", "offsets"}
    if not need <= set(t):
        raise DataError(f"{path} lacks tensors {sorted(need - set(t))}; it was not written by eaglespec")
    ids, mask, off = t["input_ids"].long(), t["loss_mask"].bool(), t["offsets"].long()
    if off.numel() == 0 or int(off[-1]) != ids.numel() or ids.numel() != mask.numel():
        raise DataError(f"{path} is inconsistent (offsets do not match the token count); delete it and rerun")
    return [Sample(ids[a:b], mask[a:b]) for a, b in zip(off[:-1].tolist(), off[1:].tolist())]


def read_manifest(root) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise DataError(f"data directory {str(root)!r} does not exist; create it with `eaglespec data regen`")
    if not path.is_file():
        raise DataError(f"{root} has no {MANIFEST}; is it an `eaglespec data regen` output directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None


def parse_part(text: str | None) -> tuple[int, int]:
    """'I/N' -> (I, N): this machine does shards I, I + N, I + 2N, ... (None: all shards, (0, 1))."""
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part takes I/N (this machine's index and the number of machines), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--part {text}: need 0 <= I < N")
    return i, n


def load_samples(root, *, target_fingerprint: str | None = None) -> list[Sample]:
    """All samples of a data directory, in shard order; checks that every listed shard is complete."""
    root = Path(root)
    man = read_manifest(root)
    if target_fingerprint is not None and man.get("target_fingerprint") not in (None, target_fingerprint):
        raise DataError(
            f"{root} was generated for another target (vocab/tokenizer fingerprint {man.get('target_fingerprint')}, "
            f"this target has {target_fingerprint}); regenerate the data with this target"
        )
    return [s for i in range(man["num_shards"]) for s in load_shard(root, i)]


def load_shard(root, index: int) -> list[Sample]:
    path = shard_path(Path(root), index)
    if not path.is_file():
        raise DataError(f"{root} is incomplete: {path.name} is missing; rerun `eaglespec data regen` to resume")
    return read_shard(path)
