"""Speculation settings tuned by `eaglespec bench --auto`, read by `eaglespec generate`.

Stored in one JSON file per user and machine: $EAGLESPEC_TUNED_FILE, else
$XDG_CACHE_HOME/eaglespec/tuned.json (default ~/.cache/eaglespec/tuned.json). Not next to the
drafter: model folders may be read-only or tracked by git, and the best settings belong to the
machine, not to the model. Entries are keyed by the resolved target and drafter paths and carry a
fingerprint (size and mtime of config.json and the weight files); when a model changes on disk its
entry no longer applies and generate falls back to the defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

# tree_depth None: 4 for a fixed tree, the policy's maximum (engine.AUTO_MAX_DEPTH) for auto
DEFAULTS = {"mode": "auto", "tree_depth": None, "tree_topk": 4, "tree_tokens": 16, "chain_k": 4}
SPEC_ARGS = tuple(DEFAULTS)


def tuned_path() -> Path:
    env = os.environ.get("EAGLESPEC_TUNED_FILE")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "eaglespec" / "tuned.json"


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


def read_all(path: Path | None = None) -> dict:
    path = path or tuned_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def save_tuned(target, draft, settings: dict, measured: dict | None = None, path: Path | None = None) -> Path:
    path = path or tuned_path()
    bad = set(settings) - set(SPEC_ARGS)
    if bad:
        raise ValueError(f"unknown tuned settings {sorted(bad)}")
    data = read_all(path)
    data[model_key(target, draft)] = {
        "target": str(Path(target).resolve()), "draft": str(Path(draft).resolve()),
        "fingerprint": {"target": fingerprint(target), "draft": fingerprint(draft)},
        "settings": settings, "measured": measured or {}, "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_tuned(target, draft, path: Path | None = None) -> dict | None:
    """The saved entry for this target+drafter, or None (missing, or a model changed since)."""
    entry = read_all(path).get(model_key(target, draft))
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
