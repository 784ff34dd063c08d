"""Built-in targets at realistic shapes with random weights, for cost benchmarks without downloads.

Step cost depends on shapes, not on weight values, so a seeded random model of a real architecture
times like the real one (acceptance does not carry over: use --synthetic-acceptance). Each shape is
written once, through transformers' own config class and our regular loader, as bf16 safetensors under
~/.cache/eaglespec/shapes/<name>/{target,drafter} ($EAGLESPEC_CACHE_DIR replaces ~/.cache/eaglespec),
with a matching random EAGLE-3.1 drafter. There is no tokenizer: prompts are random token ids. For
llama.cpp's converter, a shape whose vocabulary has the bundled tokenizer's size gets a `gguf-source` folder
(the target's files linked, the bundled tokenizer copied) that only the converter reads (`gguf_source`).

  qwen2-365m    Qwen2-0.5B's decoder stack (hidden 896, 24 layers, MLP 4864, 14/2 heads, head_dim 64,
                qkv bias, tied) with an 8K vocabulary instead of 152K: 365.2M parameters; drafter
                with the full 8K draft vocabulary.
  llama-3.2-1b  Llama-3.2-1B as configured upstream (hidden 2048, 16 layers, MLP 8192, 32/8 heads,
                head_dim 64, the real 128,256-token vocabulary, tied, llama3 RoPE scaling): 1,235.8M
                parameters, 2.5 GB on disk, ~5 GB resident in fp32; drafter with a 2048-token draft
                vocabulary (lm_head 2048 x 2048), as EAGLE-3 drafters use a reduced one.
The drafters' logits are made peaked (DRAFT_LOGIT_STD) so their trees have realistic depth.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..machine import cache_dir

INIT_STD = 0.02  # small, so activations stay finite through every layer in bf16/fp16 too
# std of the random drafter's logits: peaked like a trained drafter's, so EAGLE-2 trees reach their full
# depth (with near-uniform logits every deep node scores below every shallow one: depth-2 trees)
DRAFT_LOGIT_STD = 6.0
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    family: str  # transformers model_type: "qwen2" or "llama"
    config: dict  # keyword arguments of the transformers config class
    draft_vocab: int
    params: int  # the documented parameter count (tied embedding counted once)
    note: str


SHAPES = {
    "qwen2-365m": Shape(
        "qwen2",
        {"vocab_size": 8192, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
         "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False},
        draft_vocab=8192,
        params=365_238_144,
        note="Qwen2-0.5B decoder stack with an 8K vocabulary",
    ),
    "llama-3.2-1b": Shape(
        "llama",
        {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
         "rope_theta": 500_000.0, "rope_scaling": LLAMA3_ROPE, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
        draft_vocab=2048,
        params=1_235_814_400,
        note="Llama-3.2-1B shape, real 128K vocabulary",
    ),
}  # fmt: skip


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def hf_config(shape: Shape):
    """The transformers config object (no EOS: generation always runs to max_new_tokens)."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[shape.family]
    return cls(**shape.config, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def param_count(cfg) -> int:
    """Parameters of a Llama/Qwen2 decoder from its config, by formula (tied embedding counted once)."""
    h, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads
    qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd if qkv_bias else 0)
    layer = attn + 3 * h * inter + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * layer + h + embed


def random_tensors(cfg, seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named state dict with norms 1, biases 0, matrices N(0, INIT_STD); lm_head omitted when tied."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in skeleton.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = torch.empty(p.shape, dtype=dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, INIT_STD, generator=g)
        out[name] = t
    return out


def random_drafter(target_cfg, shape: Shape, seed: int):
    """A random EAGLE-3.1 drafter sized for the target (TargetConfig), with the target's RoPE.

    Its final norm weight is set so the logits have std DRAFT_LOGIT_STD (unit-RMS input x lm_head rows
    of std INIT_STD: std = weight * INIT_STD * sqrt(hidden)).
    """
    from ..models.drafter import Eagle3Drafter
    from ..models.drafter_config import new_drafter_config

    dcfg = new_drafter_config(target_cfg, draft_vocab_size=shape.draft_vocab)
    dcfg.rope_theta = float(shape.config.get("rope_theta", 10000.0))
    dcfg.rope_scaling = dict(shape.config["rope_scaling"]) if shape.config.get("rope_scaling") else None
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(dcfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD, generator=g)
        drafter.norm.weight.fill_(DRAFT_LOGIT_STD / (INIT_STD * math.sqrt(dcfg.hidden_size)))
    return drafter


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished directory into place (atomic rename); another process may have won the race."""
    try:
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_shape(name: str, root: Path | None = None, *, seed: int = 0, log=None) -> tuple[Path, Path]:
    """(target dir, drafter dir) of a built-in shape, written on first use (seeded, bf16)."""
    from ..models.checkpoint import save_drafter
    from ..models.io import save_tensors, write_json
    from ..models.llama import TargetConfig

    shape = get_shape(name)
    base = Path(root) if root is not None else cache_dir() / "shapes" / name
    target, drafter = base / "target", base / "drafter"
    cfg = hf_config(shape)
    if not (target / "config.json").is_file():
        if log:
            log(f"[bench] writing random {name} target ({shape.params / 1e6:.1f}M parameters, bf16) to {target}")
        tmp = base / f"target.tmp{os.getpid()}"
        save_tensors(random_tensors(cfg, seed), tmp)
        cfg.save_pretrained(str(tmp))
        write_json({"shape": name, "seed": seed, "init_std": INIT_STD, "params": shape.params, "note": shape.note},
                   tmp / "shape.json")  # fmt: skip
        _publish(tmp, target)
    if not (drafter / "config.json").is_file():
        tmp = base / f"drafter.tmp{os.getpid()}"
        save_drafter(random_drafter(TargetConfig.from_hf(cfg), shape, seed + 1), tmp, dtype="bf16")
        _publish(tmp, drafter)
    return target, drafter


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def gguf_source(name: str, target: Path) -> Path:
    """A folder llama.cpp's converter can read for a shape's target: its config and weights linked, plus
    the bundled tokenizer (prompts stay random ids; only the vocabulary's size and types matter)."""
    from ..settings import default_models_dir

    bundled = default_models_dir() / "target"
    vocab = get_shape(name).config["vocab_size"]
    bundled_vocab = json.loads((bundled / "config.json").read_text())["vocab_size"] if bundled.is_dir() else None
    if bundled_vocab != vocab:
        raise ValueError(f"llama.cpp peers need a tokenizer with {vocab} entries for --shape {name}; the bundled "
                         f"one has {bundled_vocab}: use --shape qwen2-365m or --methods plain,chain,tree")  # fmt: skip
    out = target.parent / "gguf-source"
    out.mkdir(exist_ok=True)
    for f in target.glob("*.safetensors*"):
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((target / "config.json").read_text())
    config.setdefault("architectures", [ARCHITECTURES[get_shape(name).family]])  # how the converter picks a class
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in TOKENIZER_FILES:
        if (bundled / f).is_file():
            shutil.copyfile(bundled / f, out / f)
    return out


def describe(name: str) -> dict:
    """What the report says about a shape."""
    s = get_shape(name)
    return {"name": name, "note": s.note, "params": s.params, "draft_vocab": s.draft_vocab,
            "weights": f"random N(0, {INIT_STD}), seeded; bf16 on disk"}  # fmt: skip


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> dict:
    """{"random": [Prompt]} of `count` prompts of `length` uniform token ids (seeded; no tokenizer needed)."""
    from ..suites import Prompt

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (count, length), generator=g).tolist()
    return {"random": [Prompt(f"random/{i:02d}", "random", row) for i, row in enumerate(ids)]}
