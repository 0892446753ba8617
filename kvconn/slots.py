"""Checking the pool slots a caller names for a batch of blocks.

Slots are refused before anything is read or written: a count other than one slot per
block, a slot outside its group, and one slot named for two different blocks -- a load
would leave only the last of them in it while reporting both loaded, and a save would
store that slot's bytes under both blocks' keys. (The same block twice in one slot is
harmless and allowed.) ``NO_SLOT`` (-1) is allowed any number of times: the group has no
slot for that block (vLLM's null block outside a sliding window), so its page is neither
saved nor loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvconn.errors import ArgumentError
from kvconn.layout import NO_SLOT, KvLayout

#: What callers pass: one sequence for every layer group, or one per group.
Slots = Sequence[int] | torch.Tensor | Mapping[int, Sequence[int] | torch.Tensor]
#: Each layer group's slots, one per block, as a CPU long tensor.
SlotMap = dict[int, torch.Tensor]


def slot_map(layout: KvLayout, slots: Slots, hashes: Sequence[bytes]) -> SlotMap:
    """Each layer group's slots for ``hashes``, checked (see the module docstring)."""
    groups = [g.index for g in layout.groups]
    if isinstance(slots, Mapping):
        missing = sorted(set(groups) - set(slots))
        if missing:
            raise ArgumentError(f"slots are missing for layer group(s) {missing}")
        unknown = sorted(map(repr, set(slots) - set(groups)))
        if unknown:
            raise ArgumentError(
                f"slots name layer group(s) {', '.join(unknown)} that the layout does not "
                f"have (its groups: {groups})"
            )
    # One conversion per distinct sequence: usually one list serves every group.
    converted: dict[int, tuple[torch.Tensor, list[int]]] = {}
    out: SlotMap = {}
    for g in groups:
        seq = slots[g] if isinstance(slots, Mapping) else slots
        if id(seq) not in converted:
            converted[id(seq)] = _slot_list(seq, g, hashes)
        t, values = converted[id(seq)]
        num_slots = layout.group(g).num_slots
        if values and (min(values) < NO_SLOT or max(values) >= num_slots):
            raise ArgumentError(
                f"layer group {g}: slot out of range [0, {num_slots}) "
                f"(or NO_SLOT, {NO_SLOT}): {values[:8]}"
            )
        out[g] = t
    return out


def concat(maps: Sequence[SlotMap]) -> SlotMap:
    """One slot map for several batches in a row (a step's saves, stored together)."""
    if len(maps) == 1:
        return maps[0]
    return {g: torch.cat([m[g] for m in maps]) for g in maps[0]}


def _slot_list(seq: object, g: int, hashes: Sequence[bytes]) -> tuple[torch.Tensor, list[int]]:
    """``seq`` as a 1-D long tensor and a list, one slot per block, no slot shared."""
    n = len(hashes)
    if isinstance(seq, (str, bytes, bytearray)):
        raise ArgumentError(f"layer group {g}: slots must be a sequence of ints, got {seq!r:.80}")
    try:
        given = torch.as_tensor(seq)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ArgumentError(
            f"layer group {g}: slots must be a sequence of ints, got {seq!r:.80}"
        ) from None
    if given.dim() != 1:
        raise ArgumentError(
            f"layer group {g}: slots must be one-dimensional, one per block, "
            f"got shape {tuple(given.shape)}"
        )
    if given.numel() and (
        given.is_floating_point() or given.is_complex() or given.dtype == torch.bool
    ):
        raise ArgumentError(f"layer group {g}: slots must be integers, got {given.dtype}")
    t = given.to(torch.long).cpu()
    if t.numel() != n:
        raise ArgumentError(f"layer group {g}: {t.numel()} slots for {n} blocks")
    values: list[int] = t.tolist()
    if len(set(values)) < n:
        owner: dict[int, bytes] = {}
        for i, (slot, h) in enumerate(zip(values, hashes)):
            if slot != NO_SLOT and owner.setdefault(slot, h) != h:
                raise ArgumentError(
                    f"layer group {g}: slot {slot} is given for two different blocks "
                    f"(block {values.index(slot)} and block {i}); each block needs its own slot"
                )
    return t, values
