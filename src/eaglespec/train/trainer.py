"""`eaglespec train`: train an EAGLE-3.1 (or EAGLE-3) drafter for a target with training-time test.

Online (default): the target runs inside the loop and gives exact distributions. Offline (--states):
cached aux states and top-k target probabilities from `eaglespec data states`.
One process, or `torchrun --nproc-per-node N -m eaglespec.cli train ...` for DistributedDataParallel
(gloo on CPU, nccl on GPU; distributed.py): each rank takes its share of every global batch, gradients are
averaged, and the result equals one process at the same global batch (the loss is a mean over samples).

This file sets a run up from its TrainConfig (config.py) and runs the loop; the schedule and data order are
in schedule.py, checkpoints and resume in checkpoints.py, held-out loss and real tau in evaluate.py,
metrics and plots in report.py.

Run directory:
  checkpoints/step-NNNNNN/  portable drafter (config.json + model.safetensors, fp32) + train_state.pt
  final/                    the finished drafter in the engine's portable format (--save-dtype)
  metrics.jsonl             train / eval records;  plots/*.png  loss, per-step accuracy, tau
Checkpoints are written to a temporary directory and renamed, so a killed run leaves only complete
ones; --resume continues from the newest with the same data order, schedule and optimizer state.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path

import torch

from ..api import load_tokenizer
from ..models.checkpoint import load_drafter, load_target
from ..models.drafter import Eagle3Drafter
from ..models.drafter_config import new_drafter_config
from ..models.quantize import apply_quantize
from . import checkpoints
from .config import TrainConfig
from .distributed import barrier, data_parallel, init_processes, process_device, sum_over_ranks
from .evaluate import held_out_loss, held_out_prompts, real_tau
from .regen import target_fingerprint
from .report import accuracy, append_record, merge_stats, plot_metrics, say, sum_stats, truncate_records
from .schedule import epoch_batches, lr_at, split_validation
from .shards import DataError, load_samples
from .states import load_states
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
from .vocab import choose_draft_vocab, coverage_report, load_vocab, token_counts


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


class Trainer:
    """One training run: set up from `cfg` (target, data, draft vocabulary, drafter, optimizer; resumed with
    cfg.resume), then `train()`; `evaluate()` and `measure_tau()` report on the held-out samples."""

    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        self.cfg, self.progress, self.out = cfg, progress, Path(cfg.out)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.rank, self.world = init_processes(cfg.device)
        cfg.check_processes(self.world)
        self.device = process_device(cfg.device, self.rank)
        self.target = apply_quantize(load_target(cfg.target, device=str(self.device)), cfg.quantize,
                                     cfg.quantize_group).requires_grad_(False).eval()  # fmt: skip
        self.samples = self._load_samples()
        start = load_drafter(cfg.init_from, target=self.target, dtype="fp32") if cfg.init_from else None
        used = self._draft_vocab(start)
        self.states = self._load_states()
        self._plan_epochs()
        self.drafter = init_drafter(self.target, cfg, used, start).to(self.device)
        self.target_to_draft = self._target_to_draft(used)
        self.model = _TTT(self.drafter, cfg.depth)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = 0
        self._resume_or_start()
        self.ddp = data_parallel(self.model, self.device, self.world)

    # -- setup -----------------------------------------------------------------------------------
    def _load_samples(self) -> list:
        samples = load_samples(self.cfg.data, target_fingerprint=target_fingerprint(self.cfg.target))
        if not samples:
            raise DataError(f"{self.cfg.data} holds no samples")
        return samples

    def _draft_vocab(self, start: Eagle3Drafter | None) -> torch.Tensor:
        """The draft vocabulary (target ids, ascending): a warm start's own, --vocab's, or the most frequent
        assistant tokens of the data. Sets vocab_report (its coverage of the assistant tokens)."""
        vocab_size = self.target.cfg.vocab_size
        counts = token_counts(self.samples, vocab_size)
        if start is not None:
            used = start.draft_to_target.cpu()
        elif self.cfg.vocab:
            used = load_vocab(self.cfg.vocab, vocab_size)
        else:
            used = choose_draft_vocab(counts, self.cfg.draft_vocab_size or min(vocab_size, 32000))
        self.vocab_report = coverage_report(counts, used)
        return used

    def _load_states(self) -> list | None:
        """Offline features (--states), one entry per sample; None when training online."""
        if not self.cfg.states:
            return None
        width = self.target.cfg.hidden_size * len(self.target.aux_layers)
        return load_states(self.cfg.states, self.samples, width)

    def _plan_epochs(self) -> None:
        """Held-out split, steps per epoch and the schedule's length in steps."""
        cfg = self.cfg
        self.train_idx, self.val_idx = split_validation(len(self.samples), cfg.val_fraction)
        if len(self.train_idx) < cfg.batch_size:
            raise DataError(f"only {len(self.train_idx)} training samples for a batch of {cfg.batch_size}; "
                            "regenerate more data or lower --batch-size")  # fmt: skip
        self.steps_per_epoch = len(self.train_idx) // cfg.batch_size
        self.train_lengths = [min(len(self.samples[i].input_ids), cfg.max_len) for i in self.train_idx]
        self._epoch: tuple[int, list] = (-1, [])
        self.total_steps = cfg.steps or max(1, int(cfg.epochs * self.steps_per_epoch))

    def _target_to_draft(self, used: torch.Tensor) -> torch.Tensor:
        """Target id -> draft id (-1 outside the draft vocabulary), for offline top-k targets."""
        t2d = torch.full((self.target.cfg.vocab_size,), -1, dtype=torch.long, device=self.device)
        t2d[used.to(self.device)] = torch.arange(used.numel(), device=self.device)
        return t2d

    def _resume_or_start(self) -> None:
        """--resume: continue the newest checkpoint; otherwise refuse a run directory that has checkpoints."""
        if self.cfg.resume:
            path, self.step = checkpoints.resume(self.out, self.cfg, self.drafter, self.optimizer, self.target,
                                                 self.device)  # fmt: skip
            if self.rank == 0:  # drop records after the checkpoint so curves do not repeat
                truncate_records(self.out, self.step)
            self._say(f"resumed from {path} at step {self.step}")
        elif self.rank == 0:
            checkpoints.refuse_to_overwrite(self.out)

    @cached_property
    def tokenizer(self):
        """The target's tokenizer (None when its directory has none): its EOS is one of the engine's stop ids."""
        return load_tokenizer(self.cfg.target)

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

    def _my_samples(self) -> list[int]:
        """This process's share of the current step's global batch (sample indices)."""
        local = self.cfg.batch_size // self.world
        epoch, k = divmod(self.step, self.steps_per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_batches(self.train_lengths, self.cfg, epoch))
        order = self._epoch[1][k]
        return [self.train_idx[i] for i in order[self.rank * local : (self.rank + 1) * local]]

    def _autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    # -- loop ------------------------------------------------------------------------------------
    def _accumulate_gradients(self, mine: list[int]) -> tuple[float, list[dict], int]:
        """Forward and backward over `mine` in micro-batches: (the global batch's mean loss, its counts per
        TTT step, this process's tokens)."""
        cfg = self.cfg
        micro = [mine[i : i + cfg.micro_batch] for i in range(0, len(mine), cfg.micro_batch)]
        step_loss, step_stats, tokens = 0.0, None, 0
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
            tokens += int(batch.lengths.sum())
            step_stats = merge_stats(step_stats, stats)
        if self.world > 1:  # the logged loss and accuracy cover the whole global batch
            step_loss, step_stats = sum_over_ranks(step_loss, step_stats)
        return step_loss, step_stats, tokens

    def train(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        last_step = min(self.total_steps, cfg.stop_after or self.total_steps)
        self._say(
            f"training {self.drafter.cfg.eagle_version} drafter: {len(self.train_idx)} train / {len(self.val_idx)} "
            f"held-out samples, {self.total_steps} steps of {cfg.batch_size} samples, depth {cfg.depth}, "
            f"draft vocab {self.drafter.cfg.draft_vocab_size} (coverage {self.vocab_report['coverage']:.3f}), "
            f"{'offline' if self.states else 'online'}, {self.world} process(es)"
        )
        bar = tqdm(total=last_step, initial=self.step, disable=not (self.progress and self.rank == 0), desc="train")
        t_log, tokens_log, window = time.perf_counter(), 0, []
        self.model.train()
        while self.step < last_step:
            lr = lr_at(self.step, cfg, self.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            step_loss, step_stats, tokens = self._accumulate_gradients(self._my_samples())
            tokens_log += tokens
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.step += 1
            bar.update(1)
            window.append((step_loss, step_stats))
            if self.step % cfg.log_every == 0 or self.step == last_step:
                dt = time.perf_counter() - t_log
                self._log({"kind": "train", "step": self.step, "lr": lr, "grad_norm": float(gnorm),
                           "loss": sum(w[0] for w in window) / len(window),
                           "step_accuracy": accuracy(sum_stats([w[1] for w in window])),
                           "tokens_per_s": tokens_log * self.world / dt})  # fmt: skip
                t_log, tokens_log, window = time.perf_counter(), 0, []
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == last_step:
                barrier(self.world)
                if self.rank == 0:
                    checkpoints.save_checkpoint(self.out, self.step, self.drafter, self.optimizer, cfg, self._card())
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == self.total_steps):
                if self.rank == 0:
                    self.evaluate()
                barrier(self.world)
        bar.close()
        result = {"step": self.step, "finished": self.step >= self.total_steps}
        if result["finished"] and self.rank == 0:
            result["drafter"] = str(checkpoints.save_final(self.out, self.drafter, cfg.save_dtype, self._card()))
            self.plot()
        return result

    def _card(self) -> dict:
        return checkpoints.training_card(self.cfg, self.step, self.vocab_report["coverage"])

    # -- evaluation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        val = self.val_idx[: self.cfg.eval_samples]
        rec = {"kind": "eval", "step": self.step}
        if val:
            rec.update(held_out_loss(self.model, self._features, val, self.cfg))
            rec.update(self.measure_tau())
        self.model.train()
        self._log(rec)
        self.plot()
        return rec

    def eval_prompts(self) -> list[list[int]]:
        """Held-out prompts: each held-out sample up to its first assistant token."""
        return held_out_prompts(self.samples, self.val_idx, self.cfg)

    def measure_tau(self) -> dict:
        """Real acceptance: the engine generates greedily on held-out prompts with this drafter, and stops
        where `eaglespec generate` stops (the target's EOS ids, its tokenizer's included)."""
        return real_tau(self.target, self.drafter, self.eval_prompts(), self.cfg, self.tokenizer)

    # -- reporting (process 0) -----------------------------------------------------------------------
    def _say(self, msg: str) -> None:
        if self.rank == 0:
            say(msg)

    def _log(self, rec: dict) -> None:
        if self.rank == 0:
            append_record(self.out, rec, progress=self.progress)

    def plot(self) -> list[Path]:
        return plot_metrics(self.out / "metrics.jsonl", self.out / "plots")
