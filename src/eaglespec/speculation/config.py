"""How an engine speculates: one frozen settings object, the draft tree's shape, and the one home of
their defaults. No torch here: command-line parsers import it.

`SpecConfig` is built once per engine (engine.py) and read by the core, the policies and the proposer;
the command line (settings.py) takes its flag defaults from here, so `generate`, `serve`, `bench` and
the Python API share one set.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

MODES = ("auto", "tree", "chain", "off")
AUTO_WIDTHS = (1, 2, 4)  # drafting widths the policy chooses among (1 = chain)
AUTO_MAX_DEPTH = 8
AUTO_MAX_NODES = 48
NGRAM_MAX = 8  # most tokens copied from the context per step
DRAFT_PREFILL_WINDOW = 128  # prompt pairs fed to the drafter at prefill (0: all); BENCHMARKS.md, drafter window
DEFAULT_CHAIN_K = 4


@dataclass(frozen=True)
class TreeShape:
    """depth: max draft tokens on a path; top_k: children per expanded node and frontier width;
    num_nodes: draft tokens kept for verification. A chain is top_k=1, num_nodes=depth."""

    depth: int = 4
    top_k: int = 4
    num_nodes: int = 16

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.num_nodes < 1:
            raise ValueError(f"tree depth, top-k and node count must be >= 1, got {self}")

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(depth=k, top_k=1, num_nodes=k)

    @property
    def max_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def kept_nodes(self) -> int:
        return min(self.num_nodes, self.max_candidates)


@dataclass(frozen=True)
class SpecConfig:
    """mode: "auto" (the cost-aware policy, speculation/policy.py, picks width, depth and nodes per step
    from calibrated costs; `tree.depth`, when given, is its maximum depth), "tree" (EAGLE-2 dynamic tree
    of `tree` shape), "chain" (`chain_k` tokens), "off" (plain decoding; also when there is no drafter).
    adaptive: plain steps while speculation measures slower (never changes output); False forces it.
    confidence: fixed shapes only: stop drafting below this cumulative draft probability.
    ngram_tokens: hybrid proposer: up to this many tokens copied from the context (prompt lookup) join
    each step's tree (None: NGRAM_MAX for auto, 0 for fixed shapes).
    draft_prefill_window: the last N prompt pairs the drafter reads at prefill (0: the whole prompt).
    synthetic_acceptance: benchmarks only: accept by this per-position profile instead of the target
    (not lossless)."""

    mode: str = "auto"
    tree: TreeShape | None = None
    chain_k: int = DEFAULT_CHAIN_K
    adaptive: bool = True
    confidence: float = 0.0
    ngram_tokens: int | None = None
    draft_prefill_window: int = DRAFT_PREFILL_WINDOW
    synthetic_acceptance: tuple[float, ...] | None = field(default=None)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {self.confidence!r}")
        if not isinstance(self.chain_k, int) or self.chain_k < 1:
            raise ValueError(f"chain_k must be an integer >= 1, got {self.chain_k!r}")
        w = self.draft_prefill_window
        if w is None:
            object.__setattr__(self, "draft_prefill_window", DRAFT_PREFILL_WINDOW)
        elif not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"the drafter's prefill window (draft_prefill_window) must be an integer >= 0 "
                             f"(0: the whole prompt), got {w!r}")  # fmt: skip
        n = self.ngram_tokens
        if n is not None and (not isinstance(n, int) or not 0 <= n <= NGRAM_MAX):
            raise ValueError(f"ngram_tokens must be an integer in [0, {NGRAM_MAX}], got {n!r}")
        if self.synthetic_acceptance is not None:
            object.__setattr__(self, "synthetic_acceptance", tuple(self.synthetic_acceptance) or None)

    def without_drafter(self) -> SpecConfig:
        """The config an engine runs with when it has no drafter: plain decoding."""
        return self if self.mode == "off" else replace(self, mode="off")

    @property
    def speculates(self) -> bool:
        return self.mode != "off"

    @cached_property  # read every decoding step; the config is frozen
    def shape(self) -> TreeShape | None:
        """The drafting shape: a fixed tree or chain, or auto's maxima (depth, width, nodes); None when off."""
        if self.mode == "off":
            return None
        if self.mode == "auto":
            return TreeShape(self.tree.depth if self.tree else AUTO_MAX_DEPTH, max(AUTO_WIDTHS), AUTO_MAX_NODES)
        return TreeShape.chain(self.chain_k) if self.mode == "chain" else (self.tree or TreeShape())

    @cached_property  # read every decoding step; the config is frozen
    def copied_tokens(self) -> int:
        """Most tokens copied from the context per step (the hybrid proposer); 0 when off."""
        if self.mode == "off":
            return 0
        return self.ngram_tokens if self.ngram_tokens is not None else (NGRAM_MAX if self.mode == "auto" else 0)

    @cached_property  # read every decoding step; the config is frozen
    def prefill_window(self) -> int | None:
        """The drafter's prefill window as the core uses it: None means the whole prompt."""
        return self.draft_prefill_window or None

    @cached_property  # read every decoding step; the config is frozen
    def tree_slack(self) -> int:
        """Cache positions a step may write past a row's committed tokens (tree nodes, copied tokens)."""
        shape = self.shape
        return 1 if shape is None else max(shape.top_k * shape.depth, NGRAM_MAX) + 1
