"""Deterministic stand-ins for the KV bytes a prefill would compute.

The bytes of a region for one block are a function of exactly what determines real KV
bytes: the token prefix (the block hash names it), the layer, the role and the slice of
the role this rank holds (``replicated`` or ``w<num_shards>r<shard_index>``). Hence:

* ranks holding the same slice compute byte-identical bytes, as real replicas do, so a
  page written by one replica is correct for all of them;
* any page that loads can be checked byte for byte against what recomputation gives: a
  page from another block, layer, role or shard, a shifted copy or a flipped byte all
  differ.

With ``shard_heads`` (``G``) the slice is a head shard ``w<G>r<j>``, and a rank holding
several (a TP size below ``G``) holds their bytes one after the other, as its heads are:
so a rank at another TP size holding the same heads computes the same bytes for them,
as real ranks do, and pages shared across TP sizes verify too.

Generating bytes must stay cheap next to moving them, so each (block, region) costs one
16-byte blake2b digest; the digest is tiled over the region and XOR-ed with a fixed
pseudo-random pattern, which makes every byte position distinct (a copy shifted by any
offset does not match).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvconn.keys import shard_component
from kvconn.layout import KvLayout, Region, shard_position

_PATTERN_SEED = 0x6B76636F6E6E  # "kvconn"
_DIGEST = 16


def slice_label(layout: KvLayout, rank: int, role: str) -> str:
    """``replicated``, or the ``w<num_shards>r<shard_index>`` slice this rank holds."""
    units = layout.role(role).units
    if units == 1:
        return shard_component(None)
    pos = shard_position(rank, layout.tp_size, units)
    return shard_component(pos.num_shards, pos.shard_index)


def slice_labels(
    layout: KvLayout, rank: int, role: str, shard_heads: int | None = None
) -> list[str]:
    """The slices this rank holds of ``role``, in the order of its bytes: one, or with
    ``shard_heads`` the ``w<G>r<j>`` head shards of its heads."""
    units = layout.role(role).units
    if units == 1 or shard_heads is None:
        return [slice_label(layout, rank, role)]
    pos = shard_position(rank, layout.tp_size, units)
    parts = shard_heads // pos.num_shards
    return [shard_component(shard_heads, pos.shard_index * parts + k) for k in range(parts)]


class Synth:
    """Computes one rank's region bytes for batches of blocks.

    ``diverged``: roles this rank computes differently from the other ranks holding the
    same slice (``kvconn simulate --inject-mismatch``): the fault replica checks catch.
    """

    def __init__(
        self,
        layout: KvLayout,
        rank: int,
        model: str,
        shard_heads: int | None = None,
        diverged: frozenset[str] = frozenset(),
    ) -> None:
        self.layout = layout
        self.rank = rank
        sizes = [r.size for g in layout.groups for r in g.regions]
        width = -(-max(sizes) // _DIGEST) * _DIGEST
        gen = torch.Generator().manual_seed(_PATTERN_SEED)
        self._pattern = torch.randint(0, 256, (width,), dtype=torch.uint8, generator=gen)
        self._tags: dict[tuple[int, str], list[bytes]] = {}
        for group in layout.groups:
            for region in group.regions:
                labels = slice_labels(layout, rank, region.role, shard_heads)
                if region.role in diverged:
                    labels = [f"{label}|diverged on rank {rank}" for label in labels]
                if len(labels) > 1 and (region.unit_layout is None or region.unit_layout.outer > 1):
                    raise ValueError(
                        f"{region.label}: synthetic bytes of several head shards need each "
                        "head's bytes contiguous (a unit layout with outer = 1)"
                    )
                self._tags[(region.layer, region.role)] = [
                    f"{model}|{region.layer}|{region.role}|{label}".encode() for label in labels
                ]

    def region_bytes(self, block_hashes: Sequence[bytes], region: Region) -> torch.Tensor:
        """``[len(block_hashes), region.size]`` uint8: this rank's bytes of ``region``."""
        tags = self._tags[(region.layer, region.role)]
        if len(tags) == 1:
            return self._slice_bytes(block_hashes, tags[0], region.size)
        size = region.size // len(tags)
        return torch.cat([self._slice_bytes(block_hashes, tag, size) for tag in tags], dim=1)

    def _slice_bytes(self, block_hashes: Sequence[bytes], tag: bytes, size: int) -> torch.Tensor:
        """``[len(block_hashes), size]`` uint8: one slice's bytes of a region."""
        n = len(block_hashes)
        if n == 0:
            return torch.empty((0, size), dtype=torch.uint8)
        digests = bytearray()
        for h in block_hashes:
            digests += hashlib.blake2b(
                h + tag, digest_size=_DIGEST, person=b"kvconn-synth"
            ).digest()
        base = torch.frombuffer(digests, dtype=torch.uint8).view(n, _DIGEST)
        reps = -(-size // _DIGEST)
        if size % _DIGEST == 0:  # the common case: work on 8-byte words
            words = base.view(torch.int64).repeat(1, reps)
            pattern = self._pattern[:size].view(torch.int64)
            return torch.bitwise_xor(words, pattern).view(torch.uint8)
        tiled = base.repeat(1, reps)[:, :size]
        return torch.bitwise_xor(tiled, self._pattern[:size])
