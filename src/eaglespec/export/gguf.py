"""GGUF for llama.cpp: the target (Llama architecture) and its EAGLE-3 drafter (`eagle3` architecture),
written with the `gguf` package, laid out as llama.cpp's own convert_hf_to_gguf.py lays them out (tested
against it: same keys, same tensors, same bytes):
- tensors are read as float32 and stored as `outtype` (f32, f16, bf16, q8_0 with gguf's own quantizer;
  q8_0 falls back to f16 for a row length not divisible by 32); 1-D tensors and norms stay f32;
- Q and K rows are permuted from HF's rotate-half layout to llama.cpp's interleaved RoPE layout;
- the drafter carries the target's tokenizer, `eagle3.target_layers` (capture-before-layer ids),
  `eagle3.target_hidden_size`, `eagle3.norm_before_residual`, `eagle3.norm_before_fc`, and `d2t` as
  int64 *absolute target ids* (llama.cpp's layout; safetensors checkpoints store offsets).
llama.cpp's EAGLE-3 has no fc_norm and no norm_output, so EAGLE-3.1 drafters are refused: there is no
faithful conversion (a single norm over the concatenation is a different model).
Tokenizer: a GPT-2 byte-level BPE is written from tokenizer.json (pre-tokenizer "gpt-2"); any other
tokenizer is copied from an existing GGUF of the target (`target_gguf`), e.g. one llama.cpp's converter wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..models.io import CheckpointError, load_tensors

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA_ARCH_FAMILIES = ("llama", "mistral")  # model types that llama.cpp runs as its `llama` architecture

# drafter tensor (dialect A name) -> GGUF name in llama.cpp's eagle3 architecture
DRAFTER_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",  # norm_before_fc
    "embed_tokens.weight": "token_embd.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}


class UnsupportedForGGUF(CheckpointError):
    """The model has parts llama.cpp cannot represent."""


def check_drafter(cfg) -> None:
    flags = [f for f in ("fc_norm", "norm_output", "fc_bias", "attention_bias", "mlp_bias") if getattr(cfg, f)]
    if flags:
        what = "EAGLE-3.1 drafter" if cfg.fc_norm or cfg.norm_output else "drafter"
        raise UnsupportedForGGUF(
            f"{what} with {', '.join(f + '=true' for f in flags)} cannot run in llama.cpp: its EAGLE-3 has no "
            "fc_norm mapping (one RMSNorm per captured target state before fc), no norm_output and no biases, and no "
            "faithful conversion exists; export an EAGLE-3 drafter for llama.cpp (e.g. models/drafter-eagle3), "
            "or this one with --format eagle3 / speculators for vLLM and SGLang"
        )
    if cfg.rope_scaling:
        raise UnsupportedForGGUF(f"drafter RoPE scaling {cfg.rope_scaling} is not written by this exporter")


def is_gpt2_byte_level(model_dir) -> bool:
    """tokenizer.json is a byte-level BPE with exactly GPT-2's pre-tokenization (what llama.cpp's 'gpt-2' does)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return False
    tok = json.loads(path.read_text())
    pre, model = tok.get("pre_tokenizer") or {}, tok.get("model") or {}
    bpe = model.get("type") == "BPE" and not model.get("byte_fallback") and tok.get("normalizer") is None
    return bpe and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")


def permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved pairs, per head (what its converter's permute does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def file_type(outtype: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]  # fmt: skip


def encode(name: str, t: torch.Tensor, outtype: str):
    """(data, GGML type) the way llama.cpp's converter stores this tensor."""
    import gguf

    if not t.is_floating_point():
        return t.numpy().astype(np.int64), gguf.GGMLQuantizationType.I64
    data = t.to(torch.float32).numpy()
    if data.ndim <= 1 or name.endswith("_norm.weight") or outtype == "f32":
        return data, gguf.GGMLQuantizationType.F32
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]  # fmt: skip
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # a row length the block type cannot hold: f16, as the converter does
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def add_layer_keys(w, arch: str, cfg: dict, outtype: str) -> None:
    """The hyperparameters every Llama-shaped model carries (cfg holds HF config names)."""
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])
    w.add_uint32("general.file_type", int(file_type(outtype)))
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)


def add_tokenizer(w, target_dir: Path, target_gguf: Path | None) -> None:
    """tokenizer.* keys: copied from an existing GGUF of the target, or written for a GPT-2 byte-level BPE."""
    import gguf

    if target_gguf is not None:
        reader = gguf.GGUFReader(str(target_gguf))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), vtype, sub_type=sub)
        return
    if not is_gpt2_byte_level(target_dir):
        raise CheckpointError(
            f"{target_dir}: this exporter writes llama.cpp's tokenizer metadata for GPT-2 byte-level BPE tokenizers "
            "only; for others (Llama 3, Qwen, SentencePiece) pass --target-gguf with a GGUF of the target written "
            "by llama.cpp's convert_hf_to_gguf.py, and its tokenizer is copied")  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    vocab_size = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        text = by_id[i]
        if i in added:
            looks_special = text.startswith("<|") and text.endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(text)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    gguf.SpecialVocab(str(target_dir), load_merges=True).add_to_gguf(w, quiet=True)


def write_file(path: Path, arch: str, name: str, keys, tensors: list[tuple[str, np.ndarray, object]],
               params: int) -> Path:  # fmt: skip
    """One GGUF file, written to a temporary name and renamed (no half-written file under the final name)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        w.add_size_label(gguf.size_label(params, 0, 0, 0))
        keys(w)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tname, data, qtype in tensors:
            w.add_tensor(tname, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def hf_config(target_dir: Path) -> dict:
    """The target's config with rope_theta resolved (transformers 5 keeps it in rope_parameters)."""
    raw = json.loads((target_dir / "config.json").read_text())
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise CheckpointError(f"{target_dir}: RoPE scaling {scaling} is not written by this exporter; convert the "
                              "target with llama.cpp's convert_hf_to_gguf.py and pass it as --target-gguf")  # fmt: skip
    return {**raw, "rope_theta": raw.get("rope_theta", rope.get("rope_theta", 10000.0))}


def write_target_gguf(target_dir, path: Path, outtype: str = "f32") -> Path:
    import gguf

    target_dir = Path(target_dir)
    cfg = hf_config(target_dir)
    if cfg.get("model_type") not in LLAMA_ARCH_FAMILIES:
        raise CheckpointError(f"{target_dir}: model_type {cfg.get('model_type')!r}: this exporter writes Llama-"
                              f"architecture targets ({', '.join(LLAMA_ARCH_FAMILIES)}); convert others with "
                              "llama.cpp's convert_hf_to_gguf.py and pass the result as --target-gguf")  # fmt: skip
    if "quantization_config" in cfg:
        raise CheckpointError(f"{target_dir} is a quantized checkpoint; export the full-precision target "
                              "(--outtype q8_0 quantizes for llama.cpp)")  # fmt: skip
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tensors, params = [], 0
    for key, t in load_tensors(target_dir).items():
        params += t.numel()
        if key.endswith("rotary_emb.inv_freq"):
            continue
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise CheckpointError(f"{target_dir}: tensor {key} has no llama.cpp name")
        if key.endswith("q_proj.weight"):
            t = permute_rope_rows(t, heads)
        elif key.endswith("k_proj.weight"):
            t = permute_rope_rows(t, kv_heads)
        tensors.append((new, *encode(new, t, outtype)))
    keys = lambda w: (add_layer_keys(w, "llama", cfg, outtype), add_tokenizer(w, target_dir, None))
    return write_file(Path(path), "llama", target_dir.name, keys, tensors, params)


def write_drafter_gguf(src, path: Path, outtype: str = "f32", target_gguf: Path | None = None) -> Path:
    cfg = src.cfg
    check_drafter(cfg)
    tensors = []
    for key, t in src.tensors(torch.float32).items():
        if key == "t2d":  # llama.cpp maps draft ids with d2t only
            continue
        if key == "d2t":  # llama.cpp's d2t holds absolute target ids, not offsets
            t = src.drafter.draft_to_target.cpu()
        if key not in DRAFTER_NAMES:
            raise CheckpointError(f"{src.path}: tensor {key} has no llama.cpp eagle3 name")
        if key.endswith("q_proj.weight"):
            t = permute_rope_rows(t, cfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            t = permute_rope_rows(t, cfg.num_key_value_heads)
        new = DRAFTER_NAMES[key]
        tensors.append((new, *encode(new, t, outtype)))
    layer = {"num_hidden_layers": 1, "max_position_embeddings": cfg.max_position_embeddings,
             "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "head_dim": cfg.head_size,
             "vocab_size": cfg.vocab_size}  # fmt: skip

    def keys(w):
        w.add_array("eagle3.target_layers", src.aux_layer_ids)
        w.add_uint32("eagle3.target_hidden_size", cfg.target_width)
        w.add_bool("eagle3.norm_before_residual", cfg.norm_before_residual)
        w.add_bool("eagle3.norm_before_fc", cfg.norm_before_fc)
        add_layer_keys(w, "eagle3", layer, outtype)
        add_tokenizer(w, src.target.path, target_gguf)

    params = sum(v.numel() for k, v in src.tensors().items() if k not in ("d2t", "t2d"))
    return write_file(Path(path), "eagle3", src.path.name, keys, tensors, params)


def write_gguf_pair(src, out: Path, *, outtype: str = "f32", target_gguf=None) -> list[Path]:
    """out/target-<outtype>.gguf (unless target_gguf is given) and out/drafter-<outtype>.gguf."""
    if outtype not in OUTTYPES:
        raise ValueError(f"GGUF outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    check_drafter(src.cfg)
    written = []
    if target_gguf is None:
        written.append(write_target_gguf(src.target.path, out / f"target-{outtype}.gguf", outtype))
    elif not Path(target_gguf).is_file():
        raise CheckpointError(f"--target-gguf {target_gguf} is not a file")
    written.append(write_drafter_gguf(src, out / f"drafter-{outtype}.gguf", outtype,
                                      Path(target_gguf) if target_gguf else None))  # fmt: skip
    return written
