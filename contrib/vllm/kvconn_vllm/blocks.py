"""One request's vLLM block ids, per KV-cache group, as kvconn slots.

vLLM gives a request one list of block ids per KV-cache group (a tuple indexed by group
id), in every call that concerns blocks: ``KVCacheBlocks.get_block_ids()``, a scheduled
request's ``block_ids``, a running one's ``new_block_ids``. With one group (no hybrid
allocator) the tuple has one list. Block ``i`` of a group is the ``i``-th id of its list,
and its bytes sit in slot ``id`` of that group's regions, so block ids are kvconn slots.

A sliding-window group holds vLLM's null block (id ``NULL_BLOCK_ID``, 0) for blocks
outside its window, both when vLLM allocates a hit (``add_local_computed_blocks`` pads
the skipped blocks with it) and after it frees them (``remove_skipped_blocks``). Such a
block has no slot: :data:`kvconn.layout.NO_SLOT`, which kvconn neither saves nor loads.

Kept apart from the connector so that a later asynchronous connector can reuse it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

from kvconn.layout import NO_SLOT

#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``); the
#: connector passes vLLM's own constant, this default keeps the module free of vLLM.
NULL_BLOCK_ID = 0

__all__ = ["NULL_BLOCK_ID", "BlockTable"]


class BlockTable:
    """The block ids of one request in the groups kvconn stores (vLLM group ids)."""

    def __init__(self, groups: Iterable[int], null_block_id: int = NULL_BLOCK_ID) -> None:
        self.ids: dict[int, list[int]] = {g: [] for g in groups}
        self._null = null_block_id

    def replace(self, block_ids: Sequence[Sequence[int]] | None) -> None:
        """Every group's ids anew (a request scheduled for the first time, or resumed)."""
        for g, ids in self.ids.items():
            ids[:] = block_ids[g] if block_ids is not None else []

    def extend(self, block_ids: Sequence[Sequence[int]] | None) -> None:
        """The ids vLLM added this step (``None``: none)."""
        if block_ids is None:
            return
        for g, ids in self.ids.items():
            ids.extend(block_ids[g])

    def __len__(self) -> int:
        """Blocks that every group has an id (or the null block) for."""
        return min((len(ids) for ids in self.ids.values()), default=0)

    def slots(self, start: int, stop: int) -> dict[int, list[int]]:
        """kvconn slots of blocks ``[start, stop)`` per group; ``NO_SLOT`` for null blocks."""
        return {
            g: [NO_SLOT if b == self._null else b for b in ids[start:stop]]
            for g, ids in self.ids.items()
        }

    def first_in(self, group: int, wanted: Container[int], stop: int) -> int | None:
        """The first block index below ``stop`` whose id in ``group`` is in ``wanted``."""
        return next((i for i, b in enumerate(self.ids[group][:stop]) if b in wanted), None)
