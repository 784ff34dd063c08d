"""Speculation settings tuned by `eaglespec bench --auto`, read by `eaglespec generate`.

Stored in one JSON file per user and machine: $EAGLESPEC_TUNED_FILE, else tuned.json beside the
measurement caches (machine.cache_dir(): $EAGLESPEC_CACHE_DIR, else $XDG_CACHE_HOME/eaglespec, by default
~/.cache/eaglespec). Not next to the drafter: model folders may be read-only or tracked by git, and the
best settings belong to the machine, not to the model. Entries are keyed by the resolved target and
drafter paths and carry a fingerprint (size and mtime of config.json and the weight files); when a
model changes on disk its entry no longer applies and generate falls back to the defaults.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from ..machine import cache_file, read_cached, write_cached

# the settings bench --auto tunes (settings.EngineSettings fields; tree_depth None: the mode's default)
SPEC_ARGS = ("mode", "tree_depth", "tree_topk", "tree_tokens", "chain_k")
CACHE = "tuned.json"  # in machine.cache_dir()


def tuned_path() -> Path:
    env = os.environ.get("EAGLESPEC_TUNED_FILE")
    return Path(env) if env else cache_file(CACHE)


def fingerprint(model_dir) -> str:
    d = Path(model_dir)
    parts = []
    for f in sorted([d / "config.json", *d.glob("*.safetensors"), *d.glob("*.bin")]):
        if f.is_file():
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def model_key(target, draft) -> str:
    return f"{Path(target).resolve()}|{Path(draft).resolve()}"


def save_tuned(target, draft, settings: dict, measured: dict | None = None, path: Path | None = None) -> Path:
    path = path or tuned_path()
    bad = set(settings) - set(SPEC_ARGS)
    if bad:
        raise ValueError(f"unknown tuned settings {sorted(bad)}")
    error = write_cached(path, model_key(target, draft), {
        "target": str(Path(target).resolve()), "draft": str(Path(draft).resolve()),
        "fingerprint": {"target": fingerprint(target), "draft": fingerprint(draft)},
        "settings": settings, "measured": measured or {}, "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })  # fmt: skip
    if error is not None:  # unlike a measurement, the user asked for this file
        raise error
    return path


def load_tuned(target, draft, path: Path | None = None) -> dict | None:
    """The saved entry for this target+drafter, or None (missing, or a model changed since)."""
    entry = read_cached(path or tuned_path()).get(model_key(target, draft))
    if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict):
        return None
    if entry.get("fingerprint") != {"target": fingerprint(target), "draft": fingerprint(draft)}:
        return None
    return entry


def describe(settings: dict) -> str:
    if settings["mode"] == "chain":
        return f"mode=chain chain_k={settings['chain_k']}"
    if settings["mode"] == "off":
        return "mode=off"
    if settings["mode"] == "auto":
        return f"mode=auto (cost-aware policy: chain or tree, depth <= {settings['tree_depth']}, nodes per step)"
    return f"mode=tree depth={settings['tree_depth']} topk={settings['tree_topk']} tokens={settings['tree_tokens']}"
