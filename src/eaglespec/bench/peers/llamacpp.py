"""llama.cpp as a bench peer: plain greedy decoding and EAGLE-3 (`--spec-type draft-eagle3`), same prompts.

One llama-server per method, started when the method is built (model loading stays out of every measured
run) and stopped at exit. Its /completion endpoint takes the prompt as token ids (tokenization is ours,
identical by construction) and returns the generated token ids, so the bench's lossless check compares
them with plain -- at fp32 only: in bf16/fp16 the two implementations round differently, so those rows
are marked not lossless (left out of the check) rather than reported as mismatches. Greedy = samplers
[top_k] with top_k 1; no prompt cache between requests; one slot; weights and KV cache in the bench dtype.

Time: the row's tokens/s is the bench's wall clock over the HTTP round trips (prefill + decode, like our
methods' wall). llama.cpp's own clock (prompt eval and decode ms, decode tokens/s) and its draft counts
(draft tokens, accepted, verification steps, from /metrics) are kept per run call in method.timings and
summed over every call but the first (the runner's warm-up) into settings["llamacpp_clock"].
EAGLE-3 rows carry llama.cpp's draft counts and per-position accepted counts as stats, so tau = 1 +
accepted / verification steps (vLLM's definition, as for ours); their time split is prefill = llama.cpp's
prompt eval, other = its whole decode (drafting and verification are not timed apart).
llama.cpp stops at any end-of-generation token of its vocabulary (it adds <|endoftext|>-like tokens);
outputs are cut after our first stop id, so a difference there shows up as a length difference, not a
mismatch.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ...models.llamacpp.library import BUILD_HINT, llamacpp_root
from ...stats import SpecStats
from ..method import Method, MethodRun

KINDS = ("llamacpp_plain", "llamacpp_eagle3")
SERVER = "llama-server"
OUTTYPE = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # bench dtype -> GGUF weights and KV cache type
STARTUP_TIMEOUT_S = 300
CONVERTER_MODULES = ("sentencepiece", "yaml")  # convert_hf_to_gguf.py and its gguf-py import them; not our deps
PIP_NAME = {"yaml": "pyyaml"}
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never via a proxy


def not_built_reason(root: Path | None = None) -> str | None:
    """None when the server binary, the converter and its Python modules are there, else why not (with the fix)."""
    root = root or llamacpp_root()
    missing = [p for p in (root / "build" / "bin" / SERVER, root / "src" / "convert_hf_to_gguf.py") if not p.is_file()]
    if missing:
        return f"llama.cpp is not built ({', '.join(str(p) for p in missing)} missing): {BUILD_HINT}"
    absent = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if absent:
        return (f"llama.cpp's GGUF converter needs {', '.join(absent)} in this environment: "
                f"pip install {' '.join(PIP_NAME.get(m, m) for m in absent)} (scripts/llamacpp/build.sh does it)")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as r:
        return r.read()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text from /metrics -> {'n_decode_total': 7.0, '..._per_pos_total{position="0"}': 1.0, ...}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:") and " " in line:
            name, value = line[len("llamacpp:") :].split(" ", 1)
            out[name] = float(value)
    return out


class Server:
    """A llama-server child process on a free localhost port; stderr/stdout go to a log file."""

    def __init__(self, binary: Path, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        atexit.register(self.stop)
        self.wait_ready()

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if json.loads(http(self.url + "/health", timeout=5)).get("status") == "ok":
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http(self.url + "/metrics", timeout=30).decode())

    def complete(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> dict:
        body = {"prompt": ids, "n_predict": max_new_tokens, "samplers": ["top_k"], "top_k": 1, "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": ignore_eos}  # fmt: skip
        return json.loads(http(self.url + "/completion", body))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    """Our engine's convention: the output ends with (and includes) the first stop id."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


class LlamaCppMethod(Method):
    def __init__(self, name: str, kind: str, server: Server, stop_ids, settings: dict, weight_bytes: int,
                 resident_bytes: int):  # fmt: skip
        super().__init__(name, kind, settings, weight_bytes, resident_bytes,
                         lossless=settings["lossless_check"] == "yes")  # fmt: skip
        self.server, self.stop_ids = server, tuple(stop_ids)
        self.timings: list[dict] = []  # one entry per run call

    def run(self, prompts, max_new_tokens, params, batch_size):
        if not params.greedy:
            raise ValueError(f"{self.name}: only greedy decoding is wired (temperature 0)")
        before = self.server.metrics()
        outputs, latencies, prompt_ms, decode_ms, decode_n, prompt_n = [], [], 0.0, 0.0, 0, 0
        for ids in prompts:
            t0 = time.perf_counter()
            res = self.server.complete(list(ids), max_new_tokens, ignore_eos=not self.stop_ids)  # as ours: no stop
            latencies.append(time.perf_counter() - t0)
            if res.get("tokens_evaluated", len(ids)) != len(ids):
                raise RuntimeError(f"{self.name}: llama.cpp evaluated {res['tokens_evaluated']} prompt tokens, "
                                   f"we sent {len(ids)} (it must not add BOS or re-tokenize)")  # fmt: skip
            outputs.append(cut_at_stop(list(res["tokens"]), self.stop_ids))
            t = res.get("timings", {})
            prompt_ms, decode_ms = prompt_ms + t.get("prompt_ms", 0.0), decode_ms + t.get("predicted_ms", 0.0)
            prompt_n, decode_n = prompt_n + t.get("prompt_n", 0), decode_n + t.get("predicted_n", 0)
        delta = {k: v - before.get(k, 0.0) for k, v in self.server.metrics().items()}
        forwards = int(delta.get("n_decode_total", 0))
        wall, new = sum(latencies), sum(len(o) for o in outputs)
        entry = {"call": len(self.timings), "prompts": len(prompts), "prompt_tokens": prompt_n,
                 "prompt_ms": prompt_ms, "decode_tokens": decode_n, "decode_ms": decode_ms,
                 "decode_tokens_per_s": decode_n / decode_ms * 1e3 if decode_ms else None,
                 "wall_s": wall, "wall_tokens_per_s": new / wall if wall else None,
                 "target_decodes": forwards}  # fmt: skip
        stats = None
        if self.kind == "llamacpp_eagle3":
            stats = SpecStats(drafts=int(delta.get("spec_decode_num_drafts_total", 0)),
                              draft_tokens=int(delta.get("spec_decode_num_draft_tokens_total", 0)),
                              accepted=int(delta.get("spec_decode_num_accepted_tokens_total", 0)),
                              target_forwards=forwards, prompt_tokens=prompt_n, new_tokens=new,
                              time_prefill=prompt_ms / 1e3, time_other=decode_ms / 1e3, wall_time=wall,
                              accepted_per_pos=accepted_per_position(delta))  # fmt: skip
            entry.update(draft_tokens=stats.draft_tokens, accepted=stats.accepted, verify_steps=stats.drafts,
                         acceptance_rate=stats.acceptance_rate, tau=stats.tau)  # fmt: skip
        self.timings.append(entry)
        self.settings["llamacpp_clock"] = clock_summary(self.timings[1:] or self.timings)
        extra = f", acceptance {entry['acceptance_rate']:.3f}, tau {entry['tau']:.2f}" if stats else ""
        print(f"[llamacpp] {self.name}: {new} tokens, decode {entry['decode_tokens_per_s'] or 0:.1f} tok/s "
              f"(llama.cpp clock), wall {entry['wall_tokens_per_s'] or 0:.1f} tok/s{extra}",
              file=sys.stderr)  # fmt: skip
        return MethodRun(outputs, latencies, forwards, stats)


def rate(n: float, ms: float) -> float | None:
    return round(n / ms * 1e3, 1) if ms else None


def clock_summary(entries: list[dict]) -> dict:
    """llama.cpp's own clock summed over run calls, rounded for the report."""
    keys = ("prompt_tokens", "prompt_ms", "decode_tokens", "decode_ms", "draft_tokens", "accepted")
    t = {k: sum(e.get(k) or 0 for e in entries) for k in keys}
    out = {"calls": len(entries), "decode_tokens": t["decode_tokens"], "decode_s": round(t["decode_ms"] / 1e3, 4),
           "decode_tokens_per_s": rate(t["decode_tokens"], t["decode_ms"]),
           "prompt_tokens_per_s": rate(t["prompt_tokens"], t["prompt_ms"])}  # fmt: skip
    if t["draft_tokens"]:
        out["acceptance_rate"] = round(t["accepted"] / t["draft_tokens"], 4)
    return out


def accepted_per_position(metrics: dict[str, float]) -> list[int]:
    """Drafts with >= i+1 accepted tokens, i = 0.. (llama.cpp's spec_decode_num_accepted_tokens_per_pos_total)."""
    prefix = 'spec_decode_num_accepted_tokens_per_pos_total{position="'
    by_pos = {int(k[len(prefix) : -2]): int(v) for k, v in metrics.items() if k.startswith(prefix)}
    return [by_pos.get(i, 0) for i in range(max(by_pos) + 1)] if by_pos else []


def server_args(gguf: Path, threads: int, kv: str) -> list[str]:
    # the target's full context (small for the bundled models); KV cache in the weights' type (f32 at fp32, as ours)
    args = ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "0", "-ctk", kv, "-ctv", kv,
            "--metrics", "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]  # fmt: skip
    if "-q8_0-" in gguf.name:  # its AMX repacking of q8_0 segfaults at load on our Xeon (llama.cpp#20824)
        args.append("--no-repack")
    return args


def llamacpp_methods(kinds, target_dir, drafters, stop_ids, *, threads: int, dtype: str = "fp32",
                     chain_k: int = 4, source_dir=None, not_lossless: str | None = None,
                     quantize: str | None = None, gguf: Path | None = None) -> list[Method]:  # fmt: skip
    """The requested llama.cpp methods; [] with a printed reason when llama.cpp is not built.
    drafters: (label, path) pairs; EAGLE-3.1 ones are skipped with llama.cpp's missing fc_norm as reason.
    source_dir: what the converter reads (default target_dir; --shape targets need a tokenizer added);
    not_lossless: why these rows stay out of the lossless check even at f32 (random weights: near-ties).
    quantize: our target's --quantize; int8 and w8a8 run llama.cpp on q8_0 weights (its nearest format:
    its CPU dot products also round activations to 8 bits, per block of 32), int4 on q4_0 (blocks of 32
    4-bit weights with one scale, written by llama-quantize). gguf: the file our llama.cpp runtime runs: the
    peer runs that same file (same weights and kernels; its K/V type may differ from ours, so no lossless check)."""
    from ...export.llamacpp_convert import (
        UnsupportedDrafter,
        check_drafter_supported,
        convert_drafter,
        convert_target,
        quantize_gguf,
    )

    if not kinds:
        return []
    root = llamacpp_root()
    reason = not_built_reason(root)
    if reason:
        print(f"[bench] skipping {', '.join(kinds)}: {reason}", file=sys.stderr)
        return []
    if dtype not in OUTTYPE:
        raise ValueError(f"llama.cpp peer: no GGUF type for dtype {dtype!r} (choose from {', '.join(OUTTYPE)})")
    outtype = kv = OUTTYPE[dtype]
    requantize = None
    if quantize in ("int8", "w8a8"):
        outtype, not_lossless = "q8_0", not_lossless or "q8_0 (blocks of 32) quantizes unlike our int8 per channel"
    elif quantize == "int4":
        requantize, not_lossless = "q4_0", not_lossless or "q4_0 (blocks of 32) quantizes unlike our int4 groups"
    elif quantize not in (None, "none"):
        raise ValueError(f"llama.cpp peer: no GGUF type for --quantize {quantize} (int8/w8a8 -> q8_0, int4 -> q4_0)")
    draft_type = outtype  # the EAGLE-3 drafter's GGUF type
    if gguf is not None:
        target_gguf, outtype, requantize = Path(gguf), Path(gguf).name, None
        kv = "f16"  # llama-server's default: the speed a user of that file gets
        not_lossless = not_lossless or "the same GGUF as our llama.cpp runtime, with f16 K/V (ours: q8_0/f16)"
    else:
        target_gguf = convert_target(root, source_dir or target_dir, outtype)
    if requantize:
        try:
            target_gguf, outtype = quantize_gguf(root, target_gguf, requantize), requantize
        except (FileNotFoundError, RuntimeError) as e:
            print(f"[bench] skipping {', '.join(kinds)}: {e}", file=sys.stderr)
            return []
    usable = []
    if "llamacpp_eagle3" in kinds:
        for label, path in drafters:
            try:
                check_drafter_supported(path)
                usable.append((label, convert_drafter(root, path, target_dir, draft_type), str(path)))
            except UnsupportedDrafter as e:
                print(f"[bench] skipping llamacpp_eagle3 for {label}: {e}", file=sys.stderr)
        if not usable:
            print("[bench] skipping llamacpp_eagle3: no EAGLE-3 drafter (pass --draft models/drafter-eagle3)",
                  file=sys.stderr)  # fmt: skip
    lossless = ("yes" if dtype == "fp32" and not not_lossless else
                f"no: {not_lossless}" if not_lossless else f"no: {dtype} rounding differs from ours")  # fmt: skip
    return gguf_methods(target_gguf, usable, stop_ids, threads=threads, kv=kv, chain_k=chain_k,
                        plain="llamacpp_plain" in kinds, settings={"outtype": outtype, "lossless_check": lossless})


def eagle3_server_args(draft_gguf: Path, threads: int, kv: str, chain_k: int) -> list[str]:
    return ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(chain_k),
            "--spec-draft-n-min", "0", "-td", str(threads), "-tbd", str(threads), "-ctkd", kv, "-ctvd", kv]  # fmt: skip


def gguf_methods(target_gguf: Path, drafters, stop_ids, *, threads: int, kv: str, chain_k: int, plain: bool,
                 settings: dict) -> list[Method]:  # fmt: skip
    """llama-server methods over ready GGUF files: plain (if `plain`) and one EAGLE-3 method per
    (label, drafter GGUF, drafter source) in `drafters`. settings: outtype and lossless_check at least."""
    binary, logs = llamacpp_root() / "build" / "bin" / SERVER, llamacpp_root() / "logs"
    base = {"engine": "llama.cpp llama-server", "gguf": str(target_gguf), "threads": threads, "kv_cache": kv,
            "sampling": "greedy (top_k=1)", "time_source": "tokens_per_s: bench wall clock per "
            "HTTP request (prefill + decode); llama.cpp's own clock (warm-up excluded) in llamacpp_clock",
            **settings}  # fmt: skip
    size = Path(target_gguf).stat().st_size
    out: list[Method] = []
    if plain:
        server = Server(binary, server_args(target_gguf, threads, kv), logs / "llamacpp_plain.log")
        out.append(LlamaCppMethod("llamacpp_plain", "llamacpp_plain", server, stop_ids, dict(base), size, size))
    for label, draft_gguf, source in drafters:
        name = "llamacpp_eagle3" if len(drafters) == 1 else f"llamacpp_eagle3[{label}]"
        args = server_args(target_gguf, threads, kv) + eagle3_server_args(draft_gguf, threads, kv, chain_k)
        extra = {"drafter": source, "drafter_gguf": str(draft_gguf), "spec_type": "draft-eagle3",
                 "draft_n_max": chain_k}  # fmt: skip
        server = Server(binary, args, logs / f"{name}.log")
        out.append(LlamaCppMethod(name, "llamacpp_eagle3", server, stop_ids, {**base, **extra}, size,
                                  size + Path(draft_gguf).stat().st_size))  # fmt: skip
    return out
