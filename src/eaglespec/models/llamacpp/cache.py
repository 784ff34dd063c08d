"""The llama.cpp target's KV cache: one llama.cpp context, with the surface of kv_cache.KVCache.

Each slot's committed tokens are one llama.cpp sequence (`current`). A step's new tokens form a tree (a
prefill chunk or a plain step is a one-leaf tree): every leaf gets a sequence id (the first leaf the
slot's own, the others borrowed from the spare ids and started as copies of it, which in llama.cpp's
unified cache shares the cells), and every token carries the ids of the leaves below it. llama.cpp lets
a token attend to the cells of its first sequence id at positions up to its own: exactly the committed
tokens and its ancestors, the tree mask without a mask. After verification the leaf below the last
accepted node becomes the slot's sequence and the other ids go back; positions are committed length +
depth, so nothing moves. 254 sequence ids in all: at most that many slots, and the extra leaves of one
step's trees share what the slots leave.
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass

import numpy as np
import torch

from ...kv_cache import ContextLengthError, claim_free_slot
from . import library

SEQUENCES = 254  # llama.cpp's LLAMA_MAX_SEQ (256), less the companion row's and the garbage sequences
MAX_LEAVES = 64  # sequence ids one token may carry (the leaves of a tree)
MAX_CELLS = 65536  # live positions over all slots (~1.2 GB of q8_0/f16 K/V on SmolLM2); more: a clear error


@dataclass
class LlamaCppStep:
    """What `prepare` planned for one step. rows: slot per batch row; base: committed length per row;
    tokens: per row, the submitted token indices (into the step's T); seqs: per row, per submitted
    token, the sequence ids it carries (its first one decides what it sees); leaves: per row, leaf token
    index -> sequence id; mask: [B, T, T] the step's ancestor mask; ids: per row, the submitted token
    ids (filled by decode); t: the step's width."""

    rows: list[int]
    base: list[int]
    tokens: list[list[int]]
    seqs: list[list[list[int]]]
    leaves: list[dict[int, int]]
    mask: torch.Tensor
    t: int
    ids: list[list[int]] | None = None

    @property
    def write_pos(self) -> torch.Tensor:
        """[B, T] the positions of consecutive new tokens (what a prefill chunk passes as positions)."""
        return torch.tensor(self.base)[:, None] + torch.arange(self.t)


class _BatchArrays:
    """A llama_batch whose arrays live in numpy, so a step fills them with slices, not per-field calls."""

    def __init__(self, capacity: int, seqs_per_token: int):
        self.capacity, self.k = capacity, seqs_per_token
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self.seq = np.zeros((capacity, seqs_per_token), np.int32)
        base = self.seq.ctypes.data
        self.seq_ptrs = (C.POINTER(library.seq_t) * capacity)(
            *[C.cast(base + i * seqs_per_token * 4, C.POINTER(library.seq_t)) for i in range(capacity)])

        def ptr(a, t):
            return a.ctypes.data_as(C.POINTER(t))

        # the arrays never move: one struct, whose n_tokens each step sets (saves ~20 us of ctypes casts a step)
        self._batch = library.Batch(0, ptr(self.token, library.token_t), None, ptr(self.pos, library.pos_t),
                                    ptr(self.n_seq, C.c_int32), self.seq_ptrs, ptr(self.logits, C.c_int8))  # fmt: skip

    def struct(self, n: int) -> library.Batch:
        self._batch.n_tokens = n
        return self._batch


class FixedSlots:
    """Slot bookkeeping of a llama.cpp context (lengths, in_use, max_length): a fixed number of slots."""

    what = "the llama.cpp runtime's cache"

    @property
    def num_slots(self) -> int:
        return self.lengths.numel()

    def reserve(self, needed: int) -> None:
        if needed > self.max_length:
            raise ContextLengthError(
                f"sequence needs {needed} positions but the model supports {self.max_length}; "
                "shorten the prompt or lower max_new_tokens"
            )

    def add_slots(self, n: int) -> None:
        raise RuntimeError(f"{self.what} has a fixed {self.num_slots} slots; "
                           "create the engine core with a larger max_num_seqs")  # fmt: skip

    def allocate(self) -> int:
        slot = claim_free_slot(self)
        if slot is None:
            self.add_slots(1)  # raises: the slots are fixed
        return slot


class LlamaCppCache(FixedSlots):
    """num_slots sequences of up to max_length positions in one llama.cpp context (threads: its decode
    threads; kv_type: "f32", "f16" or "q8_0" K/V; max_outputs: logits rows one forward may return).

    What keeps a token's logits the same bits in a one-token step and in a verification of any size:
    - K in q8_0 (V in f16) by default: llama.cpp's CPU flash attention then always takes its per-row path
      (with f16/f32 K it splits the cells of a one-row step across threads past 512 cells, and tiles the
      rows of a 64-row forward, each summing in another order: logits 0.79 apart at 600 cells, measured);
      V stays f16, whose rows it adds without dequantizing (q8_0 V cost 34 % more per step at 800 cells);
    - attention visits a row's cells in cell order, so every sequence's cells stay in position order:
      the rejected nodes of a tree keep their cells under a garbage sequence id instead of leaving holes
      that llama.cpp would later fill with newer tokens; when the context is full it is rebuilt by
      prefilling each slot's committed tokens again (rows are independent, so the cells get the same bits);
    - min_rows 2 (models/llamacpp/target.load_exact sets it when the probe needs it): a one-token forward
      gets a companion row in a scratch sequence, because llama.cpp multiplies one row with its vector
      kernels and two or more with its tiled GEMM, which sums F32 weights in another order (measured:
      logits 0.016 apart on SmolLM2; its quantized kernels agree at one row)."""

    def __init__(self, lib, model_ptr, *, num_slots: int, max_length: int, threads: int, kv_type: str,
                 max_batch_tokens: int, max_outputs: int, min_rows: int = 1):  # fmt: skip
        self.lib, self.max_length, self.min_rows = lib, max_length, min_rows
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.in_use = [False] * num_slots
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # committed ids: what a rebuild prefills
        if num_slots > SEQUENCES:
            raise ValueError(f"the llama.cpp runtime holds at most {SEQUENCES} sequences; got {num_slots} slots")
        self.current = list(range(num_slots))  # the sequence id holding each slot's committed tokens
        self.spare = list(range(SEQUENCES - 1, num_slots - 1, -1))  # ids the extra leaves of a step borrow
        self.scratch_seq = SEQUENCES  # the companion row's own sequence (see decode)
        self.garbage_seq = SEQUENCES + 1  # cells of rejected tree nodes, never visible
        self.max_batch_tokens, self.max_outputs = max_batch_tokens, max_outputs
        self.rebuilds = 0
        p = lib.llama_context_default_params()
        p.n_ctx = min(num_slots * max_length, MAX_CELLS) + 8192  # + room for rejected nodes before a rebuild
        p.n_batch, p.n_ubatch = max_batch_tokens + 1, min(max_batch_tokens + 1, 512)
        p.n_seq_max = self.garbage_seq + 1
        p.n_outputs_max = max(max_outputs + 1, self.garbage_seq + 1)  # llama.cpp reserves one per sequence
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = library.FLASH_ATTN_ENABLED
        k_type, _, v_type = kv_type.partition("/")  # "q8_0/f16": K in q8_0, V in f16
        p.type_k, p.type_v = library.GGML_TYPE[k_type], library.GGML_TYPE[v_type or k_type]
        p.kv_unified = True  # tree branches share their cells
        p.no_perf = True
        self.ctx = lib.llama_init_from_model(model_ptr, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {p.n_ctx} cells for {num_slots} slots")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = _BatchArrays(max_batch_tokens + 1, MAX_LEAVES)
        self.pending: LlamaCppStep | None = None  # written, not yet committed
        self.aux_enabled: tuple[int, ...] = ()

    def __del__(self):
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None

    # -- slots (as KVCache; the count is fixed: FixedSlots) ---------------------------------------------
    @property
    def capacity(self) -> int:
        return self.max_length

    def allocate(self) -> int:
        slot = super().allocate()
        self.tokens[slot] = []
        return slot

    def free(self, slot: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, self.current[slot], -1, -1)
        self.in_use[slot] = False
        self.lengths[slot] = 0
        self.tokens[slot] = []

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots: only the bookkeeping moves, the cells stay where they are."""
        self.lengths[[a, b]] = self.lengths[[b, a]]
        self.in_use[a], self.in_use[b] = self.in_use[b], self.in_use[a]
        for table in (self.current, self.tokens):
            table[a], table[b] = table[b], table[a]

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.memory, False)
        self.lengths.zero_()
        self.in_use = [False] * self.num_slots
        self.tokens = [[] for _ in range(self.num_slots)]
        self.current = list(range(self.num_slots))
        self.spare = list(range(SEQUENCES - 1, self.num_slots - 1, -1))
        self.pending = None

    # -- one step ------------------------------------------------------------------------------------
    def prepare(self, rows: torch.Tensor | None, new_mask: torch.Tensor,
                new_positions: torch.Tensor | None = None) -> LlamaCppStep:  # fmt: skip
        """Plan a step of T new tokens per row after each row's committed tokens; new_mask [B, T, T]:
        mask[b, i, j] = token j is token i or one of its ancestors (causal for prefill). A token with
        no ancestor but itself past the first is padding and is not submitted."""
        self._drop_pending()
        batch, t, width = new_mask.shape
        if width != t:
            raise ValueError("the llama.cpp cache takes masks over the new tokens only")
        slots = list(range(batch)) if rows is None else rows.tolist()
        base = [int(self.lengths[s]) for s in slots]
        self.reserve(max(base) + t)
        mask = new_mask.cpu()
        valid = mask[:, :, 0].clone()
        valid[:, 0] = True
        seen_by_other = (mask & valid[:, :, None] & ~torch.eye(t, dtype=torch.bool)).any(1)  # [B, T]
        leaf = (valid & ~seen_by_other).numpy()
        valid = valid.numpy()
        tokens, seqs, leaves = [], [], []
        for b, s in enumerate(slots):
            own = np.flatnonzero(valid[b]).tolist()
            leaf_ids = np.flatnonzero(leaf[b]).tolist()
            extra = len(leaf_ids) - 1
            if extra > len(self.spare) or len(leaf_ids) > MAX_LEAVES:
                for done in leaves:  # give back what the earlier rows borrowed
                    self.spare += list(done.values())[1:]
                raise ValueError(f"this step's trees need more sequence ids than the llama.cpp runtime's {SEQUENCES} "
                                 f"(row {b}: {len(leaf_ids)} leaves, {len(self.spare)} spare at {len(slots)} rows); "
                                 "use chains, smaller trees or fewer rows")  # fmt: skip
            seq_of = dict(zip(leaf_ids, [self.current[s]] + [self.spare.pop() for _ in range(extra)]))
            tokens.append(own)
            if extra == 0:  # a chain (prefill, plain step): every token in the row's own sequence
                seqs.append([[self.current[s]]] * len(own))
            else:
                below = mask[b][leaf_ids].numpy()  # [leaves, T]: which tokens lie on each leaf's branch
                ids = np.array([seq_of[leaf] for leaf in leaf_ids])
                seqs.append([ids[below[:, i]].tolist() for i in own])
            leaves.append(seq_of)
        self.pending = LlamaCppStep(slots, base, tokens, seqs, leaves, mask, t)  # undone by the next prepare
        self._branch_out(self.pending)
        return self.pending

    def decode(self, step: LlamaCppStep, ids: torch.Tensor, positions: torch.Tensor, last_only: bool) -> int:
        """Submit the planned tokens; logits for every token, or for each row's last one. Returns the
        number of logits rows."""
        n = sum(len(tok) for tok in step.tokens)
        if n > self.max_batch_tokens:
            raise ValueError(f"{n} tokens in one forward; the llama.cpp context takes {self.max_batch_tokens}")
        outputs = len(step.tokens) if last_only else n
        if outputs > self.max_outputs:
            raise ValueError(f"{outputs} logits rows in one forward; the llama.cpp context returns {self.max_outputs}")
        ids_host, pos_host = ids.cpu().numpy(), positions.cpu().numpy()
        step.ids = [ids_host[b, own].tolist() for b, own in enumerate(step.tokens)]

        def fill() -> None:
            arr, at = self.batch, 0
            arr.logits[:n] = 0 if last_only else 1
            for b, (own, seqs) in enumerate(zip(step.tokens, step.seqs)):
                m = len(own)
                arr.token[at : at + m] = ids_host[b, own]
                arr.pos[at : at + m] = pos_host[b, own]
                if len(step.leaves[b]) == 1:  # one sequence for the whole row
                    arr.n_seq[at : at + m], arr.seq[at : at + m, 0] = 1, seqs[0][0]
                else:
                    for i, carried in enumerate(seqs):
                        arr.n_seq[at + i] = len(carried)
                        arr.seq[at + i, : len(carried)] = carried
                if last_only:
                    arr.logits[at + m - 1] = 1
                at += m

        fill()
        if self._submit(n) == 1:  # no room left for this batch: rebuild the context, then try once more
            self._rebuild()
            self._branch_out(step)
            fill()
            code = self._submit(n)
            if code != 0:
                raise RuntimeError(f"llama_decode failed with code {code} on a batch of {n} tokens after a rebuild")
        return outputs

    def commit(self, rows: torch.Tensor | None, counts: torch.Tensor) -> None:
        """Keep the first counts[b] tokens written in the last step of row b (a chain: prefill, plain).
        With no step written (cost calibration pretends a context), counts[b] filler tokens are written."""
        if self.pending is None:
            self._fill(list(range(len(counts))) if rows is None else rows.tolist(), [int(c) for c in counts])
            return
        step = self._take_pending(rows)
        for b in range(len(step.rows)):
            self._settle(step, b, step.tokens[b][: int(counts[b])])

    def compact(self, rows: torch.Tensor | None, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep the accepted path keep[b, :counts[b]] (token indices, root first) of the last step."""
        step = self._take_pending(rows)
        paths = keep.cpu().tolist()
        for b in range(len(step.rows)):
            self._settle(step, b, paths[b][: int(counts[b])])

    # -- internals -----------------------------------------------------------------------------------
    def _submit(self, n: int) -> int:
        """llama_decode over the first n batch entries (plus the companion row when min_rows asks)."""
        arr = self.batch
        companion = n < self.min_rows
        if companion:  # a second row, with logits, in a sequence of its own: every matmul then sees >= 2 rows
            arr.token[n], arr.pos[n], arr.n_seq[n], arr.logits[n] = arr.token[0], 0, 1, 1
            arr.seq[n, 0] = self.scratch_seq
        code = self.lib.llama_decode(self.ctx, arr.struct(n + companion))
        if companion:
            self.lib.llama_memory_seq_rm(self.memory, self.scratch_seq, -1, -1)
        if code not in (0, 1):
            raise RuntimeError(f"llama_decode failed with code {code} on a batch of {n} tokens")
        return code

    def _branch_out(self, step: LlamaCppStep) -> None:
        """Every leaf but the first starts as a copy of the row's committed sequence (shared cells)."""
        for b, s in enumerate(step.rows):
            for q in list(step.leaves[b].values())[1:]:
                self.lib.llama_memory_seq_cp(self.memory, self.current[s], q, -1, -1)

    def _settle(self, step: LlamaCppStep, b: int, path: list[int]) -> None:
        """Row b keeps the tokens `path` (indices, root first, a prefix of one branch) of the step: the
        leaf below the last one becomes its committed sequence, cut after the path; every other written
        token's cell goes to the garbage sequence (kept, so later tokens never fill a hole before it)."""
        s, base, mask = step.rows[b], step.base[b], step.mask[b]
        index = {node: i for i, node in enumerate(step.tokens[b])}
        on_path = mask[path[-1]] if path else torch.zeros(step.t, dtype=torch.bool)
        kept = step.seqs[b][index[path[-1]]][0] if path else self.current[s]
        for leaf, q in step.leaves[b].items():
            shared = int((mask[leaf] & on_path).sum())  # the branch's first nodes lie on the path
            self.lib.llama_memory_seq_cp(self.memory, q, self.garbage_seq, base + shared, -1)
            self.lib.llama_memory_seq_rm(self.memory, q, *((base + len(path), -1) if q == kept else (-1, -1)))
            if q != kept:
                self.spare.append(q)
        self.current[s] = kept
        self.lengths[s] += len(path)
        if step.ids is not None:
            self.tokens[s] += [step.ids[b][index[node]] for node in path]

    def _rebuild(self) -> None:
        """Clear the context (garbage included) and prefill every live slot's committed tokens again."""
        self.rebuilds += 1
        self.lib.llama_memory_clear(self.memory, False)
        arr = self.batch
        for s in range(self.num_slots):
            ids = self.tokens[s] if self.in_use[s] else []
            for start in range(0, len(ids), self.max_batch_tokens):
                n = min(self.max_batch_tokens, len(ids) - start)
                arr.token[:n] = ids[start : start + n]
                arr.pos[:n] = start + np.arange(n)
                arr.n_seq[:n], arr.seq[:n, 0], arr.logits[:n] = 1, self.current[s], 0
                arr.logits[n - 1] = 1
                if self._submit(n) != 0:
                    raise RuntimeError(f"the llama.cpp context cannot hold the {len(ids)} tokens of slot {s}")

    def _fill(self, slots: list[int], counts: list[int]) -> None:
        arr = self.batch
        for s, count in zip(slots, counts):
            for start in range(0, count, self.max_batch_tokens):
                n = min(self.max_batch_tokens, count - start)
                base = int(self.lengths[s])
                filler = (np.arange(n) % 1000).tolist()  # any ids: only the cells' presence matters here
                arr.token[:n] = filler
                arr.pos[:n] = base + np.arange(n)
                arr.n_seq[:n], arr.seq[:n, 0], arr.logits[:n] = 1, self.current[s], 0
                arr.logits[n - 1] = 1
                if self._submit(n) != 0:
                    raise RuntimeError(f"llama_decode failed writing {n} filler tokens")
                self.lengths[s] += n
                self.tokens[s] += filler

    def _take_pending(self, rows) -> LlamaCppStep:
        step, self.pending = self.pending, None
        slots = None if rows is None else rows.tolist()
        if step is None or (slots is not None and slots != step.rows):
            raise RuntimeError("commit/compact must follow the forward of the same rows")
        return step

    def _drop_pending(self) -> None:
        """A step that was never committed (a probe, an abandoned forward) leaves nothing visible behind."""
        step, self.pending = self.pending, None
        if step is not None:
            for b in range(len(step.rows)):
                self._settle(step, b, [])
