"""The llama.cpp drafter's KV cache: one llama.cpp context, with the surface of kv_cache.KVCache the
proposer and the engine core use (prepare / commit / lengths / slots).

Slot s keeps its committed pairs at positions 0..lengths[s]-1 of its own sequence (`main[s]`). A draft
tree's nodes are written level by level: every new token is placed in the sequence of its parent (the
nearest earlier node its mask row sees; none: the slot's committed pairs), reusing that sequence when the
parent is its last cell and no sibling took it, else in a borrowed sequence started as a copy of the
parent's cells up to the parent (a copy shares the cells in llama.cpp's unified cache). A token then sees
exactly the committed pairs and its ancestors. When the proposer forgets the tree (a negative commit) the
borrowed sequences go back and the slot's sequence is cut at its committed length.

Unlike the target's cache nothing here must be bit-exact: drafts only decide what is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import library
from .cache import FixedSlots

SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
MAX_NODES = 256  # committed entries remembered per slot: the columns a tree level's mask may point back to


@dataclass
class DraftStep:
    """What `prepare` planned: rows (slot per batch row), places [B][T] the (sequence, position) of each
    new token (None: padding, not submitted), base [B] the committed length per row, t the step's width."""

    rows: list[int]
    places: list[list[tuple[int, int] | None]]
    base: list[int]
    t: int

    @property
    def write_pos(self) -> torch.Tensor:
        """[B, T] consecutive positions after the committed pairs (where an extend writes)."""
        return torch.tensor(self.base)[:, None] + torch.arange(self.t)


class LlamaCppDraftCache(FixedSlots):
    what = "the llama.cpp drafter's cache"

    def __init__(self, lib, model_ptr, *, num_slots: int, max_length: int, threads: int, max_batch_tokens: int):
        if num_slots >= SEQUENCES:
            raise ValueError(f"the llama.cpp drafter holds at most {SEQUENCES - 1} slots; got {num_slots}")
        self.lib, self.max_length, self.max_batch_tokens = lib, max_length, max_batch_tokens
        self.width = lib.llama_model_n_embd(model_ptr)  # the drafter's hidden size: its input states' width
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.in_use = [False] * num_slots
        self.main = list(range(num_slots))
        self.spare = list(range(SEQUENCES - 1, num_slots - 1, -1))
        self.borrowed: list[list[int]] = [[] for _ in range(num_slots)]  # per slot: sequences its tree holds
        self.nodes: list[list[tuple[int, int]]] = [[] for _ in range(num_slots)]  # committed (seq, pos), latest last
        self.pending: DraftStep | None = None
        p = lib.llama_context_default_params()
        p.n_ctx = num_slots * max_length + 1024
        p.n_batch, p.n_ubatch = max_batch_tokens, min(max_batch_tokens, 512)
        p.n_seq_max = SEQUENCES
        p.n_outputs_max = max(max_batch_tokens, SEQUENCES)
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = library.FLASH_ATTN_ENABLED
        p.kv_unified = True
        p.no_perf = True
        self.ctx = lib.llama_init_from_model(model_ptr, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a drafter context of {p.n_ctx} cells")
        lib.llama_set_embeddings_nextn(self.ctx, True, True)  # the pre-norm state of each output row
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_ext_init(self.ctx)
        self._pos = (library.pos_t * 1)()

    def __del__(self):
        if getattr(self, "batch", None):
            self.lib.llama_batch_ext_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None

    # -- slots (as KVCache; the count is fixed: FixedSlots) ---------------------------------------------
    def free(self, slot: int) -> None:
        self._forget_tree(slot)
        self.lib.llama_memory_seq_rm(self.memory, self.main[slot], -1, -1)
        self.in_use[slot] = False
        self.lengths[slot] = 0

    def swap(self, a: int, b: int) -> None:
        self.lengths[[a, b]] = self.lengths[[b, a]]
        self.in_use[a], self.in_use[b] = self.in_use[b], self.in_use[a]
        for table in (self.main, self.borrowed, self.nodes):
            table[a], table[b] = table[b], table[a]

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.memory, False)
        n = self.num_slots
        self.lengths.zero_()
        self.in_use = [False] * n
        self.main = list(range(n))
        self.spare = list(range(SEQUENCES - 1, n - 1, -1))
        self.borrowed, self.nodes = [[] for _ in range(n)], [[] for _ in range(n)]
        self.pending = None

    # -- one step ------------------------------------------------------------------------------------
    def prepare(self, rows: torch.Tensor | None, new_mask: torch.Tensor,
                new_positions: torch.Tensor | None = None) -> DraftStep:  # fmt: skip
        """Plan T new tokens per row; new_mask [B, T, R + T] as KVCache.prepare (R: the last R tree nodes
        committed in this tree, earlier levels)."""
        batch, t, width = new_mask.shape
        recent = width - t
        slots = list(range(batch)) if rows is None else rows.tolist()
        self._drop_pending()
        mask = new_mask.cpu().numpy()
        base = [int(self.lengths[s]) for s in slots]
        self.reserve(max(base) + t)
        if new_positions is None:
            positions = np.array(base)[:, None] + np.arange(t)
        else:
            positions = new_positions.cpu().numpy()
        plan = []
        for b, s in enumerate(slots):
            if recent == 0:  # a new chain or tree level 1: nothing of an earlier tree stays visible
                self._forget_tree(s)
            earlier = self.nodes[s][len(self.nodes[s]) - recent :] if recent else []
            parents = [self._parent(mask[b, i], recent + i) for i in range(t)]
            used = {earlier[p][0] for p in parents if p is not None and p < recent}
            for q in list(self.borrowed[s]):  # sequences of nodes no new token hangs from: give them back
                if q not in used:
                    self._give_back(s, q)
            tips, places = {}, []  # tips: sequences this step writes to -> their last position so far
            for i, p in enumerate(parents):
                pos = int(positions[b, i])
                if p is None:
                    parent = (self.main[s], pos - 1)
                else:
                    parent = earlier[p] if p < recent else places[p - recent]
                if parent is None:  # hangs from padding: padding too
                    places.append(None)
                    continue
                seq = parent[0]
                if tips.get(seq, self._tip(seq)) != parent[1]:
                    if p is not None and p >= recent:  # past a chunk's real tokens (they see no other token): padding
                        places.append(None)
                        continue
                    # the parent's sequence goes on past it (a sibling took it): branch off a copy up to the parent
                    if not self.spare:
                        raise ValueError(f"the drafter's trees need more than the {SEQUENCES} sequences llama.cpp "
                                         "holds; use smaller trees or fewer rows")  # fmt: skip
                    seq = self.spare.pop()
                    self.borrowed[s].append(seq)
                    self.lib.llama_memory_seq_cp(self.memory, parent[0], seq, -1, parent[1] + 1)
                tips[seq] = pos
                places.append((seq, pos))
            plan.append(places)
        self.pending = DraftStep(slots, plan, base, t)
        return self.pending

    def decode(self, step: DraftStep, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               outputs: list[list[int]]) -> list[int]:  # fmt: skip
        """Submit the planned tokens with their input states hidden [B, T, H]; outputs[b]: the token
        indices of row b whose logits and states are wanted. Returns their batch indices, row by row (what
        llama_get_logits_ith takes)."""
        lib, batch = self.lib, self.batch
        ids_host, pos_host = ids.cpu().numpy(), positions.cpu().numpy()
        self._hidden = np.ascontiguousarray(hidden.detach().float().cpu().numpy())  # alive until processed
        width = self._hidden.shape[-1]
        lib.llama_batch_ext_clear(batch)
        out_index = []
        for b, places in enumerate(step.places):
            wanted = set(outputs[b])
            for i, place in enumerate(places):
                if place is None:
                    continue
                idx = lib.llama_batch_ext_add_token(batch, place[0], int(ids_host[b, i]))
                if idx < 0:
                    raise RuntimeError(f"llama.cpp refused a drafter token (code {idx})")
                self._pos[0] = int(pos_host[b, i])
                lib.llama_batch_ext_set_pos(batch, idx, self._pos)
                row = self._hidden[b, i].ctypes.data_as(library.C.POINTER(library.C.c_float))
                lib.llama_batch_ext_set_embd_token(batch, idx, library.Embd(row, 1, width))
                lib.llama_batch_ext_set_output_logits(batch, idx, i in wanted)
                if i in wanted:
                    out_index.append(idx)
        code = lib.llama_process(self.ctx, library.PROCESS_DECODE, batch)
        if code != 0:
            raise RuntimeError(f"llama.cpp's drafter forward failed with code {code}")
        return out_index

    def commit(self, rows: torch.Tensor | None, counts: torch.Tensor) -> None:
        """Keep the first counts[b] tokens of the last step of row b; a negative count forgets the tree
        (the slot's sequence is cut at its committed length). With no step written, counts[b] filler pairs
        are written (cost calibration pretends a context)."""
        counts = [int(c) for c in counts.cpu()]
        slots = list(range(len(counts))) if rows is None else rows.tolist()
        step, self.pending = self.pending, None
        if step is None:
            for s, c in zip(slots, counts):
                if c > 0:
                    self._fill(s, c)
                elif c < 0:
                    self.lengths[s] += c
                    self._forget_tree(s)
            return
        for b, (s, c) in enumerate(zip(slots, counts)):
            self.lengths[s] += c
            self.nodes[s] = (self.nodes[s] + [p for p in step.places[b][:c] if p is not None])[-MAX_NODES:]
            self._cut(step.places[b][c:])

    # -- internals -----------------------------------------------------------------------------------
    @staticmethod
    def _parent(row: np.ndarray, index: int) -> int | None:
        """The nearest column before `index` that a token's mask row sees (its parent), or None."""
        seen = np.flatnonzero(row[:index])
        return int(seen[-1]) if seen.size else None

    def _tip(self, seq: int) -> int:
        return int(self.lib.llama_memory_seq_pos_max(self.memory, seq))

    def _cut(self, places: list[tuple[int, int]]) -> None:
        """Tokens written but not kept: drop each one's cells from its position on."""
        for place in places:
            if place is not None:
                self.lib.llama_memory_seq_rm(self.memory, place[0], place[1], -1)

    def _give_back(self, slot: int, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.borrowed[slot].remove(seq)
        self.spare.append(seq)

    def _forget_tree(self, slot: int) -> None:
        for q in list(self.borrowed[slot]):
            self._give_back(slot, q)
        self.nodes[slot] = []
        self.lib.llama_memory_seq_rm(self.memory, self.main[slot], int(self.lengths[slot]), -1)

    def _drop_pending(self) -> None:
        step, self.pending = self.pending, None
        if step is not None:
            for places in step.places:
                self._cut(places)

    def _fill(self, slot: int, count: int) -> None:
        """count filler pairs (token 0, zero state) after the slot's committed ones."""
        self._forget_tree(slot)
        for start in range(0, count, self.max_batch_tokens):
            n = min(self.max_batch_tokens, count - start)
            base = int(self.lengths[slot])
            step = DraftStep([slot], [[(self.main[slot], base + i) for i in range(n)]], [base], n)
            self.decode(step, torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n, self.width),
                        base + torch.arange(n)[None], [[n - 1]])  # fmt: skip
            self.lengths[slot] += n
