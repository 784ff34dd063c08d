"""The commands that serve an exported drafter in vLLM, SGLang and llama.cpp (printed by `eaglespec export`).

Flags as those projects document them (vLLM's `--speculative-config` JSON; SGLang's
`--speculative-*` server flags; llama.cpp's `--spec-type draft-eagle3`). `k` is the number of draft
tokens per step: a chain of k in each engine (SGLang topk 1, k + 1 verified tokens), a starting point
to tune on the serving hardware.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def vllm_command(target: str, drafter: str, k: int) -> str:
    spec = json.dumps({"method": "eagle3", "model": drafter, "num_speculative_tokens": k})
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def sglang_command(target: str, drafter: str, k: int) -> str:
    return (f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")  # fmt: skip


def llamacpp_command(target_gguf: str, drafter_gguf: str, k: int) -> str:
    return (f"llama-server -m {shlex.quote(target_gguf)} -md {shlex.quote(drafter_gguf)} --spec-type draft-eagle3 "
            f"--spec-draft-n-max {k} --spec-draft-n-min 0")  # fmt: skip


def serving_commands(fmt: str, files: list[Path], target: str, k: int) -> dict[str, str]:
    """engine name -> command line, for what `fmt` produced (`files` as returned by export_drafter)."""
    if fmt == "gguf":
        by_name = {f.name.split("-")[0]: str(f) for f in files}
        return {"llama.cpp": llamacpp_command(by_name.get("target", "TARGET.gguf"), by_name["drafter"], k)}
    drafter = str(files[0].parent)
    if fmt == "speculators":  # vLLM reads the speculators layout; SGLang reads dialect A
        return {"vLLM": vllm_command(target, drafter, k)}
    return {"vLLM": vllm_command(target, drafter, k), "SGLang": sglang_command(target, drafter, k)}
