"""HF checkpoints -> GGUF for the llama.cpp peer, with llama.cpp's own convert_hf_to_gguf.py (never copied here).

The converter runs in a child python (`python -m eaglespec.export.llamacpp_convert SRC -- ARGS`) so its
`conversion` / `gguf` modules and logging stay out of the bench process. Two adaptations, both on our side:
- our tokenizer is a plain GPT-2 byte-level BPE whose checksum the converter does not know; when tokenizer.json
  says exactly that (ByteLevel pre-tokenizer with the GPT-2 regex, no normalizer), an unrecognised checksum is
  mapped to llama.cpp's "gpt-2" pre-tokenizer, which implements that regex;
- EAGLE-3.1 drafters are refused: llama.cpp has no mapping for fc_norm (one RMSNorm per captured target
  state) nor norm_output; its norm_before_fc is a single norm over the concatenation, a different model.
Outputs are cached under <llama.cpp root>/gguf, keyed by the input files' names, sizes and mtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from .gguf import UnsupportedForGGUF, check_drafter, is_gpt2_byte_level

OUTTYPES = ("f32", "bf16", "f16", "q8_0")
UnsupportedDrafter = UnsupportedForGGUF


def check_drafter_supported(drafter_dir) -> None:
    """Raise UnsupportedDrafter for an EAGLE-3.1 drafter (or any config llama.cpp cannot represent)."""
    from ..models.drafter_config import DrafterConfig

    cfg = DrafterConfig.from_dict(json.loads((Path(drafter_dir) / "config.json").read_text()))
    try:
        check_drafter(cfg)
    except UnsupportedForGGUF as e:
        raise UnsupportedDrafter(f"{drafter_dir}: {e}") from None


def dir_signature(model_dir) -> list:
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(Path(model_dir).iterdir()) if f.is_file()]


def cached_path(root: Path, model_dir: Path, outtype: str, extra: list) -> Path:
    converter = root / "src" / "convert_hf_to_gguf.py"
    key = json.dumps([str(model_dir.resolve()), dir_signature(model_dir), outtype, extra,
                      converter.stat().st_mtime_ns])  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return root / "gguf" / f"{model_dir.name}-{outtype}-{digest}.gguf"


QUANTIZER = "llama-quantize"


def _write_with(command, out: Path, what: str) -> Path:
    """Run command(tmp) to write `out` through a temporary file, so a failed or killed run leaves no half
    file in the cache; kept when it is already there."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    proc = subprocess.run(command(tmp), capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    tmp.replace(out)
    return out


def quantize_gguf(root: Path, source: Path, qtype: str) -> Path:
    """A GGUF re-quantized by llama.cpp's own llama-quantize (e.g. q4_0 from f32), cached beside the source."""
    tool = Path(root) / "build" / "bin" / QUANTIZER
    if not tool.is_file():
        raise FileNotFoundError(f"{tool} is missing: rerun scripts/llamacpp/build.sh (it builds {QUANTIZER})")
    out = source.with_name(source.name.replace(".gguf", f"-{qtype}.gguf"))
    return _write_with(lambda tmp: [str(tool), str(source), str(tmp), qtype.upper()], out,
                       f"{QUANTIZER} {qtype} for {source}")  # fmt: skip


def run_converter(root: Path, model_dir: Path, out: Path, outtype: str, target_dir: Path | None = None) -> Path:
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")

    def command(tmp: Path) -> list[str]:
        args = [str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
        if target_dir is not None:
            args += ["--target-model-dir", str(target_dir)]
        return [sys.executable, "-m", __name__, str(root / "src"), "--", *args]

    return _write_with(command, out, f"llama.cpp convert_hf_to_gguf.py for {model_dir}")


def convert_target(root, target_dir, outtype: str = "f32") -> Path:
    root, target_dir = Path(root), Path(target_dir)
    return run_converter(root, target_dir, cached_path(root, target_dir, outtype, []), outtype)


def convert_drafter(root, drafter_dir, target_dir, outtype: str = "f32") -> Path:
    """An EAGLE-3 drafter; the converter takes the tokenizer and target layer count from target_dir."""
    root, drafter_dir, target_dir = Path(root), Path(drafter_dir), Path(target_dir)
    check_drafter_supported(drafter_dir)
    out = cached_path(root, drafter_dir, outtype, [str(target_dir.resolve()), dir_signature(target_dir)])
    return run_converter(root, drafter_dir, out, outtype, target_dir)


def patch_pre_tokenizer(text_model_cls) -> None:
    """Wrap the converter's checksum table: plain GPT-2 byte-level tokenizers it does not know become 'gpt-2'."""
    original = text_model_cls.get_vocab_base_pre
    log = logging.getLogger("hf-to-gguf")

    def get_vocab_base_pre(self, tokenizer) -> str:
        if not is_gpt2_byte_level(self.dir_model):
            return original(self, tokenizer)
        level = log.level
        log.setLevel(logging.ERROR)  # its 'not recognized' banner is expected here
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            log.setLevel(level)
            log.info("eaglespec: tokenizer.json is a plain GPT-2 byte-level BPE: using pre-tokenizer 'gpt-2'")
            return "gpt-2"
        finally:
            log.setLevel(level)

    text_model_cls.get_vocab_base_pre = get_vocab_base_pre


def converter_main(src: str, argv: list[str]) -> None:
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import convert_hf_to_gguf  # llama.cpp's script, imported from the build's source tree
    from conversion.base import TextModel

    patch_pre_tokenizer(TextModel)
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python -m eaglespec.export.llamacpp_convert LLAMACPP_SRC -- CONVERTER_ARGS...")
    converter_main(sys.argv[1], sys.argv[3:])
