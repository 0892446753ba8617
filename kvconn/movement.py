"""Gather a rank's pages out of its KV pool and scatter loaded pages back in.

A page is the concatenation of several strided regions. Copying region by region and
block by block in Python would cost a call per (block, region); instead the regions of a
page are compiled once into a few *runs*, each an ``as_strided`` view of shape
``[slots, k, size]`` over the pool, and moved with one ``index_select`` / ``index_copy_``
per run for a whole batch of blocks.

Two merges make runs few:
* regions adjacent in memory with the same stride (K then V of one layer) are one region;
* consecutive regions of equal size and stride whose bases advance by a constant step
  (the same role in layer after layer) become one run along a middle dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvconn import _scatter
from kvconn.layout import Region


@dataclass(frozen=True)
class Run:
    """Bytes ``[page_offset, page_offset + count*size)`` of every page of a batch."""

    pool: int
    base: int
    size: int
    stride: int  # between slots
    count: int
    step: int  # between consecutive pieces of the run inside one slot
    page_offset: int

    @property
    def nbytes(self) -> int:
        return self.count * self.size


def compile_runs(regions: Sequence[Region]) -> tuple[Run, ...]:
    merged: list[list[int]] = []  # [pool, base, size, stride]
    for r in regions:
        if merged:
            last = merged[-1]
            if last[0] == r.pool and last[3] == r.stride and last[1] + last[2] == r.base:
                last[2] += r.size
                continue
        merged.append([r.pool, r.base, r.size, r.stride])
    runs: list[Run] = []
    offset = 0
    i = 0
    while i < len(merged):
        pool, base, size, stride = merged[i]
        count, step = 1, 0
        if i + 1 < len(merged):
            nxt = merged[i + 1]
            # as_strided needs a positive step: pieces must ascend in memory
            if nxt[0] == pool and nxt[2] == size and nxt[3] == stride and nxt[1] > base:
                step = nxt[1] - base
                count = 2
                while (
                    i + count < len(merged)
                    and merged[i + count][0] == pool
                    and merged[i + count][2] == size
                    and merged[i + count][3] == stride
                    and merged[i + count][1] - merged[i + count - 1][1] == step
                ):
                    count += 1
        runs.append(Run(pool, base, size, stride, count, step, offset))
        offset += count * size
        i += count
    return tuple(runs)


_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(pool: torch.Tensor, run: Run) -> tuple[int, torch.dtype]:
    """The widest element that tiles a run exactly.

    Indexed copies in torch cost per element; moving 8-byte words instead of bytes makes
    ``index_copy_`` several times faster on the CPU, at no cost in generality.
    """
    for width, dtype in _WIDTHS:
        fields = (run.base, run.size, run.stride, run.step, run.page_offset, pool.storage_offset())
        if all(f % width == 0 for f in fields):
            return width, dtype
    return 1, torch.uint8


class PageMover:
    """Moves one page kind between a pool and contiguous ``[n, page_size]`` byte tensors."""

    def __init__(
        self, regions: Sequence[Region], pools: Sequence[torch.Tensor], num_slots: int
    ) -> None:
        self.page_size = sum(r.size for r in regions)
        self.num_slots = num_slots
        self.runs = compile_runs(regions)
        self.device = pools[0].device
        self._views: list[torch.Tensor] = []
        self._widths: list[int] = []
        for run in self.runs:
            flat = pools[run.pool]
            width, dtype = _word(flat, run)
            words = flat[: flat.numel() // width * width].view(dtype)
            self._widths.append(width)
            self._views.append(
                torch.as_strided(
                    words,
                    (num_slots, run.count, run.size // width),
                    (run.stride // width, run.step // width, 1),
                    # as_strided offsets count from the storage, not from the view
                    words.storage_offset() + run.base // width,
                )
            )
        #: numpy views of the same memory, for scatter on the CPU (see ``scatter``)...
        self._host_views = (
            [view.numpy() for view in self._views] if self.device.type == "cpu" else None
        )
        #: ...and, for pages in host memory (``host_page``), the address, slot stride,
        #: page offset and size of each piece, for kvconn._scatter (CPU pools only)
        self._pools = list(pools)  # the table's addresses point into these
        self._piece_table = self._pieces(self._pools) if self._host_views is not None else None

    def _pieces(self, pools: Sequence[torch.Tensor]) -> bytes:
        rows: list[tuple[int, int, int, int]] = []
        for run in self.runs:
            flat = pools[run.pool]
            # the pieces of a run whose pieces abut in the slot are one piece
            count, size = (1, run.nbytes) if run.step == run.size else (run.count, run.size)
            for c in range(count):
                # inside the pool for every slot: as_strided checked the run's view above
                base = flat.data_ptr() + run.base + c * run.step
                rows.append((base, run.stride, run.page_offset + c * size, size))
        return np.array(rows, dtype=np.int64).reshape(-1, 4).tobytes()

    def _page_bytes(self, pages: torch.Tensor, i: int) -> torch.Tensor:
        run = self.runs[i]
        part = pages[:, run.page_offset : run.page_offset + run.nbytes]
        return part.view(pages.shape[0], run.count, run.size)

    def _as_words(self, part: torch.Tensor, i: int, *, writable: bool) -> torch.Tensor | None:
        dtype = self._views[i].dtype
        if dtype == torch.uint8:
            return part
        try:
            return part.view(dtype)
        except RuntimeError:  # misaligned for the word: pages of an odd size in staging
            if writable:
                return None
            # A fresh copy, aligned: contiguous() would hand back a contiguous but
            # misaligned slice unchanged, and viewing that raises again.
            return part.clone(memory_format=torch.contiguous_format).view(dtype)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the pages of ``slots`` into ``out`` (``[len(slots), page_size]`` uint8).

        ``out``'s rows may be spaced wider than a page (``out = rows[:, :page_size]``,
        each staging row ending in the page's checksum): ``index_select`` writes such a
        strided view in place, at 0.8-1.0x the speed of a contiguous one, where
        gathering contiguously and copying into the rows would move every byte twice
        (0.45x; ``benchmarks/bench_integrity.py --gather``).

        ``out`` may live on another device than the pool (pinned host staging for a
        CUDA pool); the copy then happens once per run, after the gather on the device.
        """
        same_device = out.device == self.device
        for i, view in enumerate(self._views):
            dst = self._page_bytes(out, i)
            if same_device:
                words = self._as_words(dst, i, writable=True)
                if words is not None:
                    torch.index_select(view, 0, slots, out=words)
                    continue
            picked = torch.index_select(view, 0, slots)
            dst.copy_(picked.view(torch.uint8), non_blocking=True)

    def scatter(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages`` (``[len(slots), page_size]``) into the pool slots ``slots``.

        Like ``gather``'s ``out``, ``pages`` may be a strided view of wider rows.
        """
        if pages.device != self.device:
            pages = pages.to(self.device, non_blocking=True)
        host_slots = slots.numpy() if self._host_views is not None else None
        for i, view in enumerate(self._views):
            words = self._as_words(self._page_bytes(pages, i), i, writable=False)
            assert words is not None
            if self._host_views is not None:
                # On the CPU, torch's index_copy_ moves element by element (0.6-0.7x a
                # plain copy here); numpy's indexed assignment copies each slot's piece
                # as a block (0.9-1.05x), at every page size (bench_movement.py).
                self._host_views[i][host_slots] = words.numpy()
            else:
                view.index_copy_(0, slots, words)

    def scatter_page(self, slot: int, page: memoryview) -> None:
        """Write one page (a byte view of ``page_size`` or more) into ``slot``, on the CPU.

        For a page that is not a row of a tensor, such as a value a store lends where it
        holds it (``Backend.borrow``). All of the page's pieces go in one call that lets
        the GIL go once (kvconn._scatter): a numpy assignment per piece gave it up and had
        to win it back 24 times a page for a 24-layer model. Loads move many pages per
        call (:func:`scatter_host_pages`), this one.
        """
        scatter_host_pages([self.host_page(slot, page)])

    def host_page(self, slot: int, page: memoryview) -> HostPage:
        """:meth:`scatter_page`'s work as a :data:`HostPage`, for :func:`scatter_host_pages`."""
        if self._piece_table is None:
            raise ValueError("scatter_page moves bytes into CPU pools only")
        return (page, slot, self.num_slots, self._piece_table)


#: One page in host memory (lent by a store, or a row of staging) bound for a CPU pool
#: slot: the page, its slot, the pool's slot count, and its mover's piece table
#: (:meth:`PageMover.host_page`).
HostPage = tuple[memoryview, int, int, bytes]


def scatter_host_pages(pages: Sequence[HostPage]) -> None:
    """Write pages into their slots (of any CPU pools) in one call that lets the GIL go
    once, with streaming stores: a lent load scatters a few blocks' pages at a time
    (:mod:`kvconn.lent_load`), a load through staging its whole chunk."""
    _scatter.scatter_pages(pages)


def flat_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous pool tensor, whatever its dtype and shape."""
    if not pool.is_contiguous():
        raise ValueError("KV pools must be contiguous tensors")
    return pool.reshape(-1).view(torch.uint8)
