"""Every decoding method the bench measures side by side, by kind: our engine (engine_methods.py: plain,
auto, chain, tree per drafter) and the peers (peers/transformers_generate.py: hf_generate, hf_assisted,
prompt_lookup; peers/llamacpp.py: llamacpp_plain, llamacpp_eagle3, opt-in). build_methods makes the list
a run measures.
"""

from __future__ import annotations

import torch

from ..api import stop_ids_for
from ..engine import Engine
from ..speculation.config import TreeShape
from .engine_methods import OUR_KINDS, Models, engine_methods
from .method import Method
from .peers import llamacpp, transformers_generate
from .peers.llamacpp import llamacpp_methods
from .peers.transformers_generate import build_peers

PEER_KINDS = transformers_generate.KINDS
ALL_KINDS = OUR_KINDS + PEER_KINDS
LLAMACPP_KINDS = llamacpp.KINDS  # opt-in (not in "all"): needs scripts/llamacpp/build.sh
RANDOM_WEIGHTS = "random weights, near-tied logits"  # why --shape peers are left out of the lossless check


def parse_kinds(text: str | None) -> list[str]:
    from ..suites import parse_choices

    return list(ALL_KINDS) if text in (None, "all") else parse_choices(text, ALL_KINDS + LLAMACPP_KINDS, "methods")


def build_methods(kinds: list[str], models: Models, *, tree: TreeShape, chain_k: int, adaptive: bool = True,
                  gguf_source=None) -> list[Method]:  # fmt: skip
    """Our engine's methods, then the peers. gguf_source: a --shape target's folder for llama.cpp's converter
    (random weights: its rows stay out of the lossless check, near-tied logits round either way)."""
    methods = engine_methods(models, kinds, tree=tree, chain_k=chain_k, adaptive=adaptive)
    peers = [k for k in kinds if k in PEER_KINDS]
    llama = [k for k in kinds if k in LLAMACPP_KINDS]
    if peers or llama:
        stop_ids = stop_ids_for(Engine(models.target, None, mode="off", tokenizer=models.tokenizer))
    if peers:
        methods += build_peers(peers, models.target_dir, stop_ids, models.tokenizer, models.dtype)
    if llama:
        methods += llamacpp_methods(llama, models.target_dir, [(lb, p) for lb, p, _ in models.drafters], stop_ids,
                                    threads=torch.get_num_threads(), dtype=models.dtype, chain_k=chain_k,
                                    source_dir=gguf_source,
                                    not_lossless=RANDOM_WEIGHTS if gguf_source else None,
                                    quantize=models.quantize,
                                    gguf=getattr(models.target, "path", None))  # fmt: skip
    return methods
