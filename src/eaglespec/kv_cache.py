"""Per-sequence KV cache with tree writes, in-place path compaction and reusable slots.

Layout per layer: K and V of shape [slots, kv_heads, capacity, head_dim]. Each slot holds one sequence;
`lengths[slot]` counts its committed tokens. A step writes T new tokens of each row (slot) at cache
positions lengths[row] .. lengths[row] + T - 1 without committing them; `commit` (prefill, plain
decoding) or `compact` (speculation: keep only the accepted tree path) then advances the lengths.
Slots are independent, so a server can start and finish sequences between steps without copying the
others (continuous batching). Capacity grows on demand, so memory follows the longest live sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ContextLengthError(ValueError):
    """A sequence would exceed the model's context window."""


@dataclass
class StepMeta:
    """Everything a model's attention layers need for one step over `rows` of a cache.

    rows:       [B] slot indices (or None for slots 0..B-1, which lets reads be views).
    write_pos:  [B, T] cache positions the T new tokens are written to.
    mask:       [B, 1, T, S - start] bool, True where query t may attend to cache column start + s;
                None when every query sees every column (a plain decoding step).
    span:       one past the last cache column read this step.
    write_start: the common first write position when rows is None and every row starts there
                (the writes are then one slice copy instead of a scatter); else None.
    """

    rows: torch.Tensor | None
    write_pos: torch.Tensor
    mask: torch.Tensor | None
    span: int
    write_start: int | None = None
    start: int = 0  # first cache column read: with a sliding window, older columns are never visible


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        initial_capacity: int = 256,
        sliding_window: int | None = None,
        row_invariant: bool = False,
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.row_invariant = row_invariant  # attention over it by models/row_attention (fp32, CPU)
        self.max_length = max_length
        self.dtype, self.device = dtype, torch.device(device)
        self.sliding_window = sliding_window
        # Host-side lengths: step shapes are decided on the host, so no device sync is needed.
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.in_use = [False] * num_slots
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._allocate(num_slots, min(initial_capacity, max_length))

    # -- storage ---------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.lengths.numel()

    def _allocate(self, num_slots: int, capacity: int) -> None:
        shape = (num_slots, self.num_kv_heads, capacity, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for t in new_k + new_v:  # compiled forwards (models/compiled.py): slots and capacity change size
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        if self.k:  # keep what is stored (growth is amortised: capacity at least doubles)
            s, c = self.k[0].shape[0], self.capacity
            for old, new in zip(self.k + self.v, new_k + new_v):
                new[:s, :, :c] = old
        self.k, self.v, self.capacity = new_k, new_v, capacity

    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions per slot (raises ContextLengthError past max_length)."""
        if needed > self.max_length:
            raise ContextLengthError(
                f"sequence needs {needed} positions but the model supports {self.max_length}; "
                "shorten the prompt or lower max_new_tokens"
            )
        if needed > self.capacity:
            grown = max(needed, 2 * self.capacity)
            grown = min(-(-grown // 256) * 256, self.max_length)
            self._allocate(self.num_slots, grown)

    def add_slots(self, n: int) -> None:
        """Append n empty slots (continuous batching beyond the initial slot count)."""
        self.lengths = torch.cat([self.lengths, torch.zeros(n, dtype=torch.long)])
        self.in_use += [False] * n
        old_k, old_v = self.k, self.v
        self.k, self.v, cap = [], [], self.capacity
        self.capacity = 0
        self._allocate(self.num_slots, cap)
        for old, new in zip(old_k + old_v, self.k + self.v):
            new[: old.shape[0]] = old

    def allocate(self) -> int:
        """Take a free slot for a new sequence and return its index."""
        slot = claim_free_slot(self)
        if slot is None:
            self.add_slots(max(1, self.num_slots))
            return self.allocate()
        return slot

    def free(self, slot: int) -> None:
        self.in_use[slot] = False
        self.lengths[slot] = 0

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots (contents, lengths, use): how the core keeps its running rows in slots 0..n-1."""
        n = int(max(self.lengths[a], self.lengths[b]))
        if n:
            pair, flipped = torch.tensor([a, b], device=self.device), torch.tensor([b, a], device=self.device)
            for t in self.k + self.v:
                t[pair, :, :n] = t[flipped, :, :n]
        self.lengths[[a, b]] = self.lengths[[b, a]]
        self.in_use[a], self.in_use[b] = self.in_use[b], self.in_use[a]

    def reset(self) -> None:
        self.lengths.zero_()
        self.in_use = [False] * self.num_slots

    # -- one step --------------------------------------------------------------------------------
    def prepare(
        self,
        rows: torch.Tensor | None,
        new_mask: torch.Tensor,
        new_positions: torch.Tensor | None = None,
    ) -> StepMeta:
        """Plan a step that writes T new tokens per row after each row's committed tokens.

        new_mask: [B, T, R + T] bool. Its last T columns say which new tokens each new token sees
        (causal for prefill, ancestors for a tree); its first R columns cover the last R committed
        entries of each row (earlier tree levels of the drafter), everything before those is visible.
        new_positions: [B, T] token positions, needed only for a sliding window.
        """
        batch, t, width = new_mask.shape
        recent = width - t
        base_host = self.lengths[:batch] if rows is None else self.lengths[rows.cpu()]
        lo, hi = int(base_host.min()), int(base_host.max())
        span = hi + t
        self.reserve(span)
        write_start = lo if rows is None and lo == hi else None
        base = base_host.to(self.device, non_blocking=True)
        write_pos = base[:, None] + torch.arange(t, device=self.device)
        if t == 1 and recent == 0 and lo == hi and self.sliding_window is None:
            return StepMeta(rows, write_pos, None, span, write_start)  # one new token sees everything
        if self.sliding_window is not None and new_positions is None:
            new_positions = write_pos  # new tokens consecutive after the committed ones, as in prefill
        start = 0
        if self.sliding_window is not None:
            # read only columns some query can see, so the cost stays flat in the length. New tokens sit at
            # positions >= lo - recent - 1 (the target's after its committed tokens, the drafter's tree levels
            # after its last extended pair), so no column before this start is visible: a host-side bound,
            # no device sync
            start = max(0, lo - recent - self.sliding_window)
        cols = torch.arange(start, span, device=self.device)
        rel = cols[None, :] - (base[:, None] - recent)  # [B, S] column index into new_mask
        explicit = (rel >= 0) & (rel < width)
        picked = new_mask.gather(2, rel.clamp(0, width - 1)[:, None, :].expand(batch, t, cols.numel()))
        mask = (rel < 0)[:, None, :] | (picked & explicit[:, None, :])
        if self.sliding_window is not None:
            # committed column s holds position s; a new column holds its token's position
            new_positions = new_positions.to(self.device)
            j = (rel - recent).clamp(0, t - 1)
            col_pos = torch.where(rel >= recent, new_positions.gather(1, j), cols[None, :])
            too_far = (new_positions[:, :, None] - col_pos[:, None, :]) >= self.sliding_window
            mask &= ~too_far
        return StepMeta(rows, write_pos, mask[:, None], span, write_start, start)

    def write(self, layer: int, meta: StepMeta, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store this step's K/V ([B, kv_heads, T, hd]) at meta.write_pos."""
        k, v = self.k[layer], self.v[layer]
        batch = k_new.shape[0]
        if meta.write_start is not None:  # every row writes at the same place: slice copies
            s0, t = meta.write_start, k_new.shape[2]
            k[:batch, :, s0 : s0 + t].copy_(k_new)
            v[:batch, :, s0 : s0 + t].copy_(v_new)
            return
        rows = torch.arange(batch, device=self.device) if meta.rows is None else meta.rows
        k[rows[:, None], :, meta.write_pos] = k_new.transpose(1, 2)
        v[rows[:, None], :, meta.write_pos] = v_new.transpose(1, 2)

    def write_and_read(self, layer: int, meta: StepMeta, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store this step's K/V ([B, kv_heads, T, hd]) and return the K/V to attend over ([B, kv, S, hd])."""
        self.write(layer, meta, k_new, v_new)
        k, v = self.k[layer], self.v[layer]
        batch = k_new.shape[0]
        if meta.rows is None:
            return k[:batch, :, meta.start : meta.span], v[:batch, :, meta.start : meta.span]
        return k[meta.rows, :, meta.start : meta.span], v[meta.rows, :, meta.start : meta.span]

    def commit(self, rows: torch.Tensor | None, counts: torch.Tensor) -> None:
        """Keep the first counts[b] tokens written in the last step of row b (negative: forget)."""
        counts = counts.cpu()
        if rows is None:
            self.lengths[: counts.numel()] += counts
        else:
            self.lengths[rows.cpu()] += counts

    def compact(self, rows: torch.Tensor | None, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Move the kept tree nodes of the last step to contiguous positions and commit them.

        keep: [B, L] indices (into the step's T new tokens) of the accepted path, in order; entries
        past counts[b] are ignored. counts: [B] number of kept tokens per row.
        """
        batch, length = keep.shape
        base_host = self.lengths[:batch] if rows is None else self.lengths[rows.cpu()]
        base = base_host.to(self.device, non_blocking=True)[:, None]
        src = base + keep.to(self.device)
        dst = base + torch.arange(length, device=self.device)
        r = torch.arange(batch, device=self.device) if rows is None else rows.to(self.device)
        r = r[:, None]
        for cache in self.k + self.v:
            cache[r, :, dst] = cache[r, :, src]  # gather first, then scatter: overlap-safe
        self.commit(rows, counts)


def claim_free_slot(cache) -> int | None:
    """Mark a cache's first unused slot used, with no tokens, and return it (None: all are in use)."""
    for slot, used in enumerate(cache.in_use):
        if not used:
            cache.in_use[slot] = True
            cache.lengths[slot] = 0
            return slot
    return None


def causal_mask(counts: torch.Tensor, t: int) -> torch.Tensor:
    """[B, T, T] causal mask over T new tokens of which the first counts[b] are real."""
    idx = torch.arange(t, device=counts.device)
    valid = idx[None, :] < counts[:, None]
    causal = idx[None, :, None] >= idx[None, None, :]
    return (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=counts.device)[None]
