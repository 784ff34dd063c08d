"""`eaglespec train`: train an EAGLE-3.1 (or EAGLE-3) drafter for a target with training-time test.

Online (default): the target runs inside the loop and gives exact distributions. Offline (--states):
cached aux states and top-k target probabilities from `eaglespec data states`.
One process, or `torchrun --nproc-per-node N -m eaglespec.cli train ...` for DistributedDataParallel
(gloo on CPU, nccl on GPU): each rank takes its share of every global batch, gradients are averaged,
and the result equals one process at the same global batch (the loss is a mean over samples).

Run directory:
  checkpoints/step-NNNNNN/  portable drafter (config.json + model.safetensors, fp32) + train_state.pt
  final/                    the finished drafter in the engine's portable format (--save-dtype)
  metrics.jsonl             train / eval records;  plots/*.png  loss, per-step accuracy, tau
Checkpoints are written to a temporary directory and renamed, so a killed run leaves only complete
ones; --resume continues from the newest with the same data order, schedule and optimizer state.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..models.drafter import Eagle3Drafter, drafter_state_dict, load_drafter, new_drafter_config, save_drafter
from .shards import DataError
from .ttt import (
    Batch,
    collate,
    cropped_features,
    target_features,
    targets_from_logits,
    targets_from_topk,
    ttt_forward,
    ttt_loss,
)

# settings that must not change when a run is resumed
_FIXED_ON_RESUME = ("data", "states", "depth", "decay", "fc_norm", "norm_output", "draft_vocab_size", "batch_size",
                    "steps", "epochs", "lr", "min_lr_frac", "warmup_steps", "seed", "max_len", "val_fraction",
                    "draft_window", "draft_context", "init_from", "quantize", "quantize_group")


@dataclass
class TrainConfig:
    target: str
    data: str
    out: str
    states: str | None = None  # offline features (eaglespec data states)
    vocab: str | None = None  # eaglespec data vocab output; None: computed from the data
    draft_vocab_size: int | None = None  # None: min(target vocab, 32000)
    fc_norm: bool = True
    norm_output: bool = True
    depth: int = 7
    decay: float = 0.8
    lr: float = 5e-4
    min_lr_frac: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: float = 1.0
    steps: int | None = None  # schedule length in optimizer steps (default: from epochs)
    stop_after: int | None = None  # stop (with a checkpoint) after this step, e.g. to split a run
    batch_size: int = 8  # samples per optimizer step, over all processes
    micro_batch: int = 4  # samples per forward on one process (gradient accumulation)
    max_len: int = 1024
    dtype: str = "fp32"  # autocast dtype for the drafter: fp32 or bf16
    device: str = "cpu"
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    save_dtype: str = "bf16"
    eval_every: int = 100
    val_fraction: float = 0.05
    eval_samples: int = 64
    eval_prompts: int = 16
    eval_max_new_tokens: int = 64
    eval_mode: str = "chain"
    eval_chain_k: int = 4
    log_every: int = 10
    resume: bool = False
    threads: int | None = None
    intermediate_size: int | None = None
    draft_window: int | None = None  # the drafter's own attention window (draft_attention_window)
    draft_context: int | None = None  # the drafter trains on each sample's last N tokens (features: whole sample)
    init_from: str | None = None  # warm start from this drafter directory (its switches and vocabulary)
    quantize: str | None = None  # the target quantized at load (int8 / int4 / w8a8): train against it
    quantize_group: int | None = None
    extra: dict = field(default_factory=dict)


# -- setup -----------------------------------------------------------------------------------------
def _dist(device: str):
    """(rank, world) and initialise torch.distributed when launched by torchrun (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    prog = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_frac
    return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * prog))


def split_validation(n: int, fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic held-out split by sample index: every k-th sample is held out."""
    if fraction <= 0:
        return list(range(n)), []
    k = max(2, round(1 / fraction))
    val = list(range(0, n, k))
    held = set(val)
    return [i for i in range(n) if i not in held], val


def epoch_batches(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """The optimizer batches of one epoch (indices into the training samples): a seeded permutation,
    cut into groups of 16 batches whose samples are sorted by length before being split into batches
    (less padding), then the batches are shuffled. Deterministic in (seed, epoch), so resume replays it."""
    g = torch.Generator().manual_seed(cfg.seed * 1000003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    per_epoch = len(lengths) // cfg.batch_size
    perm = perm[: per_epoch * cfg.batch_size]
    group = 16 * cfg.batch_size
    batches = []
    for i in range(0, len(perm), group):
        chunk = sorted(perm[i : i + group], key=lambda j: lengths[j])
        batches += [chunk[k : k + cfg.batch_size] for k in range(0, len(chunk), cfg.batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[o] for o in order]


def init_drafter(target, cfg: TrainConfig, used: torch.Tensor, start: Eagle3Drafter | None = None) -> Eagle3Drafter:
    """A new drafter: frozen copy of the target embedding, lm_head rows copied from the target's lm_head for
    the draft vocabulary (as speculators does; trainable), everything else random (seeded). With `start`
    (the drafter of cfg.init_from): its weights and vocabulary instead (a warm start)."""
    if start is not None:
        drafter = start.requires_grad_(True).train()
        c = drafter.cfg
        if (c.fc_norm, c.norm_output) != (cfg.fc_norm, cfg.norm_output):
            raise ValueError(f"--init-from {cfg.init_from} has fc_norm={c.fc_norm}, norm_output={c.norm_output}; "
                             "pass the same --fc-norm/--norm-output switches")  # fmt: skip
        c.draft_attention_window = cfg.draft_window or None
    else:
        dcfg = new_drafter_config(target.cfg, draft_vocab_size=used.numel(), fc_norm=cfg.fc_norm,
                                  norm_output=cfg.norm_output, intermediate_size=cfg.intermediate_size,
                                  aux_layer_ids=None, draft_attention_window=cfg.draft_window)  # fmt: skip
        torch.manual_seed(cfg.seed)
        drafter = Eagle3Drafter(dcfg)
        drafter.set_draft_vocab(used)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(target.lm_head.weight[used].float())
    attach_frozen_embedding(drafter, target)
    return drafter


def attach_frozen_embedding(drafter: Eagle3Drafter, target) -> None:
    emb = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().float().clone(), freeze=True)
    drafter.attach_target_embedding(emb)


class _TTT(torch.nn.Module):
    """Wraps the drafter so DistributedDataParallel can own the TTT forward."""

    def __init__(self, drafter: Eagle3Drafter, depth: int):
        super().__init__()
        self.drafter, self.depth = drafter, depth

    def forward(self, aux, input_ids):
        return ttt_forward(self.drafter, aux, input_ids, self.depth)


# -- the run -----------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        from ..models.checkpoint import load_target
        from .regen import target_fingerprint
        from .shards import load_samples
        from .vocab import choose_draft_vocab, coverage_report, load_vocab, token_counts

        self.cfg, self.progress = cfg, progress
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.depth < 1:
            raise ValueError(f"depth must be >= 1, got {cfg.depth}")
        for name in ("draft_window", "draft_context"):
            value = getattr(cfg, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive number of tokens, got {value}")
        if cfg.draft_window is not None and cfg.draft_window <= cfg.depth:
            raise ValueError(f"draft-window {cfg.draft_window} must exceed the TTT depth {cfg.depth}")
        if cfg.draft_context and cfg.states:
            raise ValueError("--draft-context needs the target in the loop (online training), not --states")
        if cfg.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {cfg.dtype!r}")
        self.rank, self.world = _dist(cfg.device)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of processes {self.world}")
        gpu = f"cuda:{self.rank % max(1, torch.cuda.device_count())}"
        self.device = torch.device(gpu if cfg.device == "cuda" else cfg.device)
        self.out = Path(cfg.out)
        from ..models.quantize import apply_quantize

        target = load_target(cfg.target, device=str(self.device))
        self.target = apply_quantize(target, cfg.quantize, cfg.quantize_group).requires_grad_(False).eval()
        samples = load_samples(cfg.data, target_fingerprint=target_fingerprint(cfg.target))
        if not samples:
            raise DataError(f"{cfg.data} holds no samples")
        vocab_size = self.target.cfg.vocab_size
        counts = token_counts(samples, vocab_size)
        start = load_drafter(cfg.init_from, target=self.target, dtype="fp32") if cfg.init_from else None
        if start is not None:  # a warm start keeps the drafter's own draft vocabulary
            used = start.draft_to_target.cpu()
        elif cfg.vocab:
            used = load_vocab(cfg.vocab, vocab_size)
        else:
            used = choose_draft_vocab(counts, cfg.draft_vocab_size or min(vocab_size, 32000))
        self.vocab_report = coverage_report(counts, used)
        self.states = None
        if cfg.states:
            from .states import load_states

            width = self.target.cfg.hidden_size * len(self.target.aux_layers)
            self.states = load_states(cfg.states, samples, width)
        self.samples = samples
        self.train_idx, self.val_idx = split_validation(len(samples), cfg.val_fraction)
        if len(self.train_idx) < cfg.batch_size:
            raise DataError(f"only {len(self.train_idx)} training samples for a batch of {cfg.batch_size}; "
                            "regenerate more data or lower --batch-size")  # fmt: skip
        self.steps_per_epoch = len(self.train_idx) // cfg.batch_size
        self.train_lengths = [min(len(samples[i].input_ids), cfg.max_len) for i in self.train_idx]
        self._epoch: tuple[int, list] = (-1, [])
        self.total_steps = cfg.steps or max(1, int(cfg.epochs * self.steps_per_epoch))
        self.drafter = init_drafter(self.target, cfg, used, start).to(self.device)
        self.target_to_draft = torch.full((vocab_size,), -1, dtype=torch.long, device=self.device)
        self.target_to_draft[used.to(self.device)] = torch.arange(used.numel(), device=self.device)
        self.model = _TTT(self.drafter, cfg.depth)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = 0
        if cfg.resume:
            self._resume()
        elif self.rank == 0 and (self.out / "checkpoints").exists() and any((self.out / "checkpoints").iterdir()):
            raise ValueError(f"{self.out} already has checkpoints: pass --resume to continue, or use a new --out")
        self.ddp = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = None if self.device.type == "cpu" else [self.device]
            self.ddp = DistributedDataParallel(self.model, device_ids=ids)

    # -- checkpoints -------------------------------------------------------------------------------
    def _checkpoints(self) -> list[Path]:
        root = self.out / "checkpoints"
        return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []

    def _save_checkpoint(self) -> Path:
        root = self.out / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:06d}"
        tmp = root / f".tmp-step-{self.step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(self.drafter, tmp, dtype="fp32", extra_config={"eaglespec_training": self._card()})
        torch.save({"step": self.step, "optimizer": self.optimizer.state_dict(), "config": asdict(self.cfg)},
                   tmp / "train_state.pt")  # fmt: skip
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self._checkpoints()[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _resume(self) -> None:
        ckpts = self._checkpoints()
        if not ckpts:
            raise ValueError(f"--resume: {self.out}/checkpoints has no checkpoint to resume from")
        path = ckpts[-1]
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        saved = state["config"]
        changed = [k for k in _FIXED_ON_RESUME if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            diff = ", ".join(f"{k} ({saved.get(k)} -> {getattr(self.cfg, k)})" for k in changed)
            raise ValueError(f"--resume: {diff} "
                             "differ from the run being resumed; keep them, or start a new --out")  # fmt: skip
        loaded = load_drafter(path, target=self.target, device=str(self.device), dtype="fp32")
        self.drafter.load_state_dict(drafter_state_dict(loaded), strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        if self.rank == 0:  # drop records after the checkpoint so curves do not repeat
            log = self.out / "metrics.jsonl"
            if log.is_file():
                keep = [ln for ln in log.read_text().splitlines() if json.loads(ln).get("step", 0) <= self.step]
                log.write_text("".join(ln + "\n" for ln in keep))
        self._log_print(f"resumed from {path} at step {self.step}")

    def _card(self) -> dict:
        c = self.cfg
        return {"target": str(c.target), "quantize": c.quantize, "data": str(c.data), "depth": c.depth,
                "steps": self.step, "batch_size": c.batch_size, "lr": c.lr,
                "vocab_coverage": round(self.vocab_report["coverage"], 4)}

    # -- data ------------------------------------------------------------------------------------
    def _features(self, idx: list[int]) -> tuple[Batch, torch.Tensor, object]:
        batch = collate([self.samples[i] for i in idx], self.cfg.max_len)
        dev = self.device
        if self.states is None:
            if self.cfg.draft_context:
                batch, aux, logits = cropped_features(self.target, batch, self.cfg.draft_context)
            else:
                aux, logits = target_features(self.target, batch)
            targets = targets_from_logits(logits, self.drafter.draft_to_target, self.drafter.t2d)
        else:
            t = batch.input_ids.shape[1]
            pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, t - x.shape[0]))
            st = [self.states[i] for i in idx]
            lens = batch.lengths.tolist()
            aux = torch.stack([pad(s["aux"][:n].float()) for s, n in zip(st, lens)]).to(dev)
            top_p = torch.stack([pad(s["top_p"][:n].float()) for s, n in zip(st, lens)]).to(dev)
            top_i = torch.stack([pad(s["top_i"][:n].long()) for s, n in zip(st, lens)]).to(dev)
            targets = targets_from_topk(top_p, top_i, self.target_to_draft)
        batch = Batch(batch.input_ids.to(dev), batch.loss_mask.to(dev), batch.lengths.to(dev))
        return batch, aux, targets

    def _autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    # -- loop ------------------------------------------------------------------------------------
    def train(self) -> dict:
        from contextlib import nullcontext

        cfg = self.cfg
        local = cfg.batch_size // self.world
        last_step = min(self.total_steps, cfg.stop_after or self.total_steps)
        self._log_print(
            f"training {self.drafter.cfg.eagle_version} drafter: {len(self.train_idx)} train / {len(self.val_idx)} "
            f"held-out samples, {self.total_steps} steps of {cfg.batch_size} samples, depth {cfg.depth}, "
            f"draft vocab {self.drafter.cfg.draft_vocab_size} (coverage {self.vocab_report['coverage']:.3f}), "
            f"{'offline' if self.states else 'online'}, {self.world} process(es)"
        )
        from tqdm import tqdm

        bar = tqdm(total=last_step, initial=self.step, disable=not (self.progress and self.rank == 0), desc="train")
        t_log, tokens_log, window = time.perf_counter(), 0, []
        self.model.train()
        while self.step < last_step:
            lr = lr_at(self.step, cfg, self.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            epoch, k = divmod(self.step, self.steps_per_epoch)
            if self._epoch[0] != epoch:
                self._epoch = (epoch, epoch_batches(self.train_lengths, cfg, epoch))
            order = self._epoch[1][k]
            mine = [self.train_idx[i] for i in order[self.rank * local : (self.rank + 1) * local]]
            micro = [mine[i : i + cfg.micro_batch] for i in range(0, len(mine), cfg.micro_batch)]
            self.optimizer.zero_grad(set_to_none=True)
            step_loss, step_stats = 0.0, None
            for j, idx in enumerate(micro):
                batch, aux, targets = self._features(idx)
                sync = self.ddp.no_sync() if self.world > 1 and j < len(micro) - 1 else nullcontext()
                with sync:
                    with self._autocast():
                        logits = self.ddp(aux, batch.input_ids)
                    per_sample, stats = ttt_loss(logits, batch, targets, cfg.decay)
                    # mean over the global batch; DDP averages over processes, hence * world
                    (per_sample.sum() * self.world / cfg.batch_size).backward()
                step_loss += float(per_sample.detach().sum()) / cfg.batch_size
                tokens_log += int(batch.lengths.sum())
                step_stats = _merge(step_stats, stats)
            if self.world > 1:  # the logged loss and accuracy cover the whole global batch
                step_loss, step_stats = self._sum_over_ranks(step_loss, step_stats)
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.step += 1
            bar.update(1)
            window.append((step_loss, step_stats))
            if self.step % cfg.log_every == 0 or self.step == last_step:
                dt = time.perf_counter() - t_log
                self._log({"kind": "train", "step": self.step, "lr": lr, "grad_norm": float(gnorm),
                           "loss": sum(w[0] for w in window) / len(window),
                           "step_accuracy": _accuracy(_reduce([w[1] for w in window])),
                           "tokens_per_s": tokens_log * self.world / dt})  # fmt: skip
                t_log, tokens_log, window = time.perf_counter(), 0, []
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == last_step:
                self._barrier()
                if self.rank == 0:
                    self._save_checkpoint()
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == self.total_steps):
                if self.rank == 0:
                    self.evaluate()
                self._barrier()
        bar.close()
        result = {"step": self.step, "finished": self.step >= self.total_steps}
        if result["finished"] and self.rank == 0:
            final = self.out / "final"
            tmp = self.out / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            save_drafter(self.drafter, tmp, dtype=cfg.save_dtype, extra_config={"eaglespec_training": self._card()})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            result["drafter"] = str(final)
            self.plot()
        return result

    # -- evaluation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        cfg = self.cfg
        self.model.eval()
        val = self.val_idx[: cfg.eval_samples]
        rec = {"kind": "eval", "step": self.step}
        if val:
            stats, loss = None, 0.0
            for i in range(0, len(val), cfg.micro_batch):
                batch, aux, targets = self._features(val[i : i + cfg.micro_batch])
                per_sample, s = ttt_loss(self.model(aux, batch.input_ids), batch, targets, cfg.decay)
                loss += float(per_sample.sum())
                stats = _merge(stats, s)
            rec["val_loss"] = loss / len(val)
            rec["val_step_accuracy"] = _accuracy(stats)
            rec.update(self.measure_tau())
        self.model.train()
        self._log(rec)
        self.plot()
        return rec

    def eval_prompts(self) -> list[list[int]]:
        """Held-out prompts: each held-out sample up to its first assistant token."""
        prompts = []
        for i in self.val_idx[: self.cfg.eval_prompts]:
            s = self.samples[i]
            first = int(s.loss_mask.nonzero()[0]) if s.loss_mask.any() else len(s.input_ids) // 2
            if first >= 1:
                prompts.append(s.input_ids[:first][-self.cfg.max_len :].tolist())
        return prompts

    def measure_tau(self) -> dict:
        """Real acceptance: the engine generates greedily on held-out prompts with this drafter."""
        from ..engine import Engine, Request
        from ..sampling import SamplingParams

        prompts = self.eval_prompts()
        if not prompts:
            return {}
        drafter = copy.deepcopy(self.drafter).eval()
        engine = Engine(self.target, drafter, mode=self.cfg.eval_mode, chain_k=self.cfg.eval_chain_k, adaptive=False)
        eos = getattr(self.target.hf_config, "eos_token_id", None)
        stop = tuple([eos] if isinstance(eos, int) else (eos or []))
        reqs = [Request(p, self.cfg.eval_max_new_tokens, stop) for p in prompts]
        out = engine.generate(reqs, SamplingParams(), batch_size=min(8, len(reqs)))
        s = out.stats
        return {"tau": s.tau, "acceptance_per_position": s.per_position_acceptance,
                "eval_mode": self.cfg.eval_mode, "eval_prompts": len(prompts)}  # fmt: skip

    # -- logging ---------------------------------------------------------------------------------------
    def _sum_over_ranks(self, loss: float, stats: list[dict]) -> tuple[float, list[dict]]:
        import torch.distributed as dist

        flat = torch.tensor([loss] + [float(v) for s in stats for v in (s["correct"], s["count"])], dtype=torch.float64)
        dist.all_reduce(flat)
        vals = flat.tolist()
        return vals[0], [{"correct": int(vals[1 + 2 * k]), "count": int(vals[2 + 2 * k])} for k in range(len(stats))]

    def _barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _log_print(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[eaglespec train] {msg}", flush=True)

    def _log(self, rec: dict) -> None:
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        rec = {**rec, "time": round(time.time(), 1)}
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec["kind"] == "eval":
            acc = rec.get("val_step_accuracy") or []
            self._log_print(f"step {rec['step']}: val_loss {rec.get('val_loss', float('nan')):.4f} "
                            f"acc {[round(a, 3) for a in acc]} tau {rec.get('tau', float('nan')):.3f}")  # fmt: skip
        elif not self.progress:
            self._log_print(f"step {rec['step']}: loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                            f"{rec['tokens_per_s']:.0f} tok/s")  # fmt: skip

    def plot(self) -> list[Path]:
        return plot_metrics(self.out / "metrics.jsonl", self.out / "plots")


def _merge(acc, stats):
    if acc is None:
        return [{"correct": s["correct"], "count": s["count"]} for s in stats]
    for a, s in zip(acc, stats):
        a["correct"] += s["correct"]
        a["count"] += s["count"]
    return acc


def _reduce(items):
    out = None
    for s in items:
        out = _merge(out, s)
    return out


def _accuracy(stats) -> list[float]:
    return [s["correct"] / s["count"] if s["count"] else 0.0 for s in stats]


def plot_metrics(metrics_file, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in Path(metrics_file).read_text().splitlines() if ln.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval" and "val_loss" in r]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="TTT loss (sum over steps, decayed)", title="drafter loss")
    ax.legend()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    if evals:
        fig, ax = plt.subplots(figsize=(6, 4))
        acc = [r["val_step_accuracy"] for r in evals]
        for k in range(len(acc[0])):
            ax.plot([r["step"] for r in evals], [a[k] for a in acc], label=f"TTT step {k}")
        ax.set(xlabel="step", ylabel="held-out accuracy (top-1 = target argmax)", title="accuracy per TTT step")
        ax.legend(fontsize=7)
        paths.append(out_dir / "step_accuracy.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
        taus = [r for r in evals if "tau" in r]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in taus], [r["tau"] for r in taus], "o-")
        ax.set(xlabel="step", ylabel="tau (mean acceptance length)", title="real tau on held-out prompts")
        paths.append(out_dir / "tau.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return paths
