"""`eaglespec train` settings: TrainConfig, checked when it is made (a bad value raises a ValueError that
says what to fix)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    # the target, the data, the run directory
    target: str
    data: str
    out: str
    states: str | None = None  # offline features (eaglespec data states)
    vocab: str | None = None  # eaglespec data vocab output; None: computed from the data
    # the drafter and its TTT loss
    draft_vocab_size: int | None = None  # None: min(target vocab, 32000)
    fc_norm: bool = True
    norm_output: bool = True
    depth: int = 7
    decay: float = 0.8
    # optimizer, schedule and batches
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
    # checkpoints (checkpoints.py)
    save_every: int = 100
    keep_checkpoints: int = 2
    save_dtype: str = "bf16"
    # held-out evaluation (evaluate.py)
    eval_every: int = 100
    val_fraction: float = 0.05
    eval_samples: int = 64
    eval_prompts: int = 16
    eval_max_new_tokens: int = 64
    eval_mode: str = "chain"
    eval_chain_k: int = 4
    # logging, resume, threads
    log_every: int = 10
    resume: bool = False
    threads: int | None = None
    # drafter shape, long context, warm start, quantized target
    intermediate_size: int | None = None
    draft_window: int | None = None  # the drafter's own attention window (draft_attention_window)
    draft_context: int | None = None  # the drafter trains on each sample's last N tokens (features: whole sample)
    init_from: str | None = None  # warm start from this drafter directory (its switches and vocabulary)
    quantize: str | None = None  # the target quantized at load (int8 / int4 / w8a8): train against it
    quantize_group: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        for name in ("draft_window", "draft_context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive number of tokens, got {value}")
        if self.draft_window is not None and self.draft_window <= self.depth:
            raise ValueError(f"draft-window {self.draft_window} must exceed the TTT depth {self.depth}")
        if self.draft_context and self.states:
            raise ValueError("--draft-context needs the target in the loop (online training), not --states")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.save_dtype not in ("fp32", "bf16", "fp16"):  # checked now, not when the run saves at its end
            raise ValueError(f"save-dtype must be fp32, bf16 or fp16, got {self.save_dtype!r}")
        if self.eval_mode not in ("chain", "tree"):
            raise ValueError(f"eval-mode must be chain or tree, got {self.eval_mode!r}")
        for name, least in (("steps", 1), ("batch_size", 1), ("micro_batch", 1), ("eval_chain_k", 1),
                            ("save_every", 0), ("eval_every", 0)):  # fmt: skip  (0: never)
            value = getattr(self, name, None)
            if value is not None and (not isinstance(value, int) or value < least):
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= {least}, got {value!r}")

    def check_processes(self, world: int) -> None:
        """The global batch must split evenly over the `world` processes."""
        if self.batch_size % world:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by the number of processes {world}")
