"""The running batch's tensors between steps: what the next step starts from, row for row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PENDING_PAIRS_MAX = 16  # drafter pairs queued by plain steps that a catch-up extend feeds (see with_pending)


@dataclass
class BatchState:
    """One row per running request, in the scheduler's running order.

    root [B]          the last token the target produced (not yet in its cache): the next tree's root
    ids [B, E]        with a drafter: target tokens whose (state, token) pairs the drafter has not read yet
    aux [B, E, A*H]   the target's captured aux states for those pairs
    cnt [B]           how many of the E columns are real per row
    (ids, aux, cnt are None without a drafter)"""

    root: torch.Tensor
    ids: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    cnt: torch.Tensor | None = None

    def cat(self, other: BatchState) -> BatchState:
        """This batch's rows, then other's (pending columns padded to the wider one)."""
        root = torch.cat([self.root, other.root])
        if self.ids is None:
            return BatchState(root)
        e = max(self.ids.shape[1], other.ids.shape[1])
        ids = torch.cat([F.pad(x, (0, e - x.shape[1])) for x in (self.ids, other.ids)])
        aux = torch.cat([F.pad(x, (0, 0, 0, e - x.shape[1])) for x in (self.aux, other.aux)])
        return BatchState(root, ids, aux, torch.cat([self.cnt, other.cnt]))

    def select(self, keep: list[int]) -> BatchState:
        """The rows `keep`, in that order."""
        idx = torch.tensor(keep, device=self.root.device)
        pick = lambda x: None if x is None else x.index_select(0, idx)  # noqa: E731
        return BatchState(pick(self.root), pick(self.ids), pick(self.aux), pick(self.cnt))

    def with_pending(self, root: torch.Tensor, aux: torch.Tensor, keep: int = PENDING_PAIRS_MAX) -> BatchState:
        """After a plain step with a drafter: the new root, and one more (aux state, token) pair after each
        row's pending pairs, keeping each row's last `keep`: after a long run of plain steps the drafter
        catches up on the recent pairs only (a gap in its context, like the prefill window), so the
        catch-up forward stays small at any batch size."""
        ids, pend_aux, cnt = F.pad(self.ids, (0, 1)), F.pad(self.aux, (0, 0, 0, 1)), self.cnt
        rows = torch.arange(ids.shape[0], device=ids.device)
        ids[rows, cnt] = root
        pend_aux[rows, cnt] = aux
        cnt = cnt + 1
        if ids.shape[1] > keep:
            first = (cnt - keep).clamp(min=0)
            idx = (first[:, None] + torch.arange(keep, device=ids.device)).clamp(max=ids.shape[1] - 1)
            ids = ids.gather(1, idx)
            pend_aux = pend_aux.gather(1, idx[:, :, None].expand(-1, -1, pend_aux.shape[-1]))
            cnt = cnt.clamp(max=keep)
        return BatchState(root, ids, pend_aux, cnt)
