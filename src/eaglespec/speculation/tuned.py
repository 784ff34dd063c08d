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

# tree_depth None: 4 for a fixed tree, the policy's maximum (engine.AUTO_MAX_DEPTH) for auto
DEFAULTS = {"mode": "auto", "tree_depth": None, "tree_topk": 4, "tree_tokens": 16, "chain_k": 4}
SPEC_ARGS = tuple(DEFAULTS)
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


def generate_settings(args, target, draft) -> tuple[dict, str]:
    """Speculation settings for `generate`: the flags the user gave (others: defaults); with no such
    flag, the tuned entry for this target+drafter when there is one; else the defaults."""
    given = {k: getattr(args, k) for k in SPEC_ARGS if getattr(args, k, None) is not None}
    if given:
        if "mode" not in given:  # a shape flag without --mode asks for that fixed shape
            given["mode"] = "chain" if "chain_k" in given else "tree"
        return {**DEFAULTS, **given}, "command line"
    if draft is not None:
        entry = load_tuned(target, draft)
        if entry is not None:
            return {**DEFAULTS, **entry["settings"]}, f"tuned by bench --auto, {tuned_path()}"
    return dict(DEFAULTS), "defaults"


def describe(settings: dict) -> str:
    if settings["mode"] == "chain":
        return f"mode=chain chain_k={settings['chain_k']}"
    if settings["mode"] == "off":
        return "mode=off"
    if settings["mode"] == "auto":
        return f"mode=auto (cost-aware policy: chain or tree, depth <= {settings['tree_depth']}, nodes per step)"
    return f"mode=tree depth={settings['tree_depth']} topk={settings['tree_topk']} tokens={settings['tree_tokens']}"
