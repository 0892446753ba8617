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

A Mamba group in vLLM's ``mamba_cache_mode="align"`` is not positional: vLLM nulls
interior states, and the block at a position may hold a running state, not the one
after that position's last token. Its ids are kvconn slots only where vLLM says so:
for a save, the blocks vLLM names in ``boundary_state_offloads``; for a load, the block
vLLM just allocated at the hit's last position, where the request resumes from. Such
groups are the table's ``state_groups``; elsewhere their blocks have no slot.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from kvconn.layout import NO_SLOT

#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``); the
#: connector passes vLLM's own constant, this default keeps the module free of vLLM.
NULL_BLOCK_ID = 0

__all__ = ["NULL_BLOCK_ID", "BlockTable"]


class BlockTable:
    """The block ids of one request in the groups kvconn stores (vLLM group ids)."""

    def __init__(
        self,
        groups: Iterable[int],
        null_block_id: int = NULL_BLOCK_ID,
        state_groups: Iterable[int] = (),
    ) -> None:
        self.ids: dict[int, list[int]] = {g: [] for g in groups}
        self._null = null_block_id
        self.state_groups = frozenset(state_groups)
        if not self.state_groups <= self.ids.keys():
            raise ValueError(f"state groups {sorted(self.state_groups)} are not all groups")

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

    def slots(
        self, start: int, stop: int, states: Mapping[int, Mapping[int, int]] | None = None
    ) -> dict[int, list[int]]:
        """kvconn slots of blocks ``[start, stop)`` per group; ``NO_SLOT`` for null blocks.

        A state group's slots are ``states[group]`` (``{position: block id}``, the ones
        in range), ``NO_SLOT`` elsewhere.
        """
        out = {}
        for g, ids in self.ids.items():
            if g in self.state_groups:
                named = (states or {}).get(g, {})
                row = [named.get(i, NO_SLOT) for i in range(start, stop)]
            else:
                row = list(ids[start:stop])
            out[g] = [NO_SLOT if b == self._null else b for b in row]
        return out

    def resume_states(self, position: int) -> dict[int, dict[int, int]]:
        """The state groups' blocks at ``position``, as :meth:`slots` takes them: where
        a load of a hit ending there puts its states (vLLM allocates that block for the
        state the request resumes from)."""
        return {
            g: {position: self.ids[g][position]}
            for g in self.state_groups
            if 0 <= position < len(self.ids[g])
        }

    def first_in(self, group: int, wanted: Container[int], stop: int) -> int | None:
        """The first block index below ``stop`` whose id in ``group`` is in ``wanted``."""
        return next((i for i, b in enumerate(self.ids[group][:stop]) if b in wanted), None)
