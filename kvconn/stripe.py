"""Striped reads: which rank of a TP group reads each page of a load from the store.

A page that ``dup`` ranks hold identically (the replicated class, or a GQA head that
consecutive ranks duplicate) needs to leave the store once per group, not once per
rank. Its *reader* is the replica that the ``spread`` writer rule picks,
``writer_replica(block_hash, dup, SPREAD)``: the block hash is a uniform digest, so
reads balance across the replicas as writes do, and every rank derives the whole
assignment from the hashes alone, without talking. The reader's verified bytes then
reach the other replicas over the group (:mod:`kvconn.group`). A page only one rank
holds (``dup == 1``, a ``w<n>r<i>`` shard) is read by that rank, as without a group.

This module is the pure part: the order of a chunk's staging rows and how many of
them each rank reads, sends and receives. Torch-free, so that tests, ``kvconn
simulate`` and the benchmark derive the same figures the connector moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvconn.plan import RankShare, WriterPolicy, writer_replica


def reader_replica(block_hash: bytes, dup: int) -> int:
    """The replica index that reads this block's page from the store (spread rule)."""
    return writer_replica(block_hash, dup, WriterPolicy.SPREAD)


@dataclass(frozen=True)
class Segment:
    """The staging rows of one page kind that one replica reads: ``blocks`` in order."""

    replica: int
    first_row: int  # row index within the page kind's rows
    blocks: tuple[int, ...]  # block indices within the chunk, ascending

    def below(self, good: int) -> int:
        """Rows of this segment whose block is in the good prefix ``[0, good)``."""
        count = 0
        for block in self.blocks:
            if block >= good:
                break
            count += 1
        return count


@dataclass(frozen=True)
class StripedRows:
    """One page kind's rows in a chunk, grouped by the replica that reads them.

    Rows of a page kind are ordered replica by replica, each replica's blocks ascending,
    so that what one replica reads (and sends) and what one replica's pages arrive as
    (received) are each one contiguous run of rows, and the part of a run inside the
    good prefix is its first rows.
    """

    share: RankShare
    segments: tuple[Segment, ...]  # one per replica, replica 0 first

    @property
    def mine(self) -> Segment:
        """The rows this rank reads from the store."""
        return self.segments[self.share.replica_index]

    def peers(self) -> list[tuple[int, Segment]]:
        """``(group rank, segment)`` of every other replica of this rank's shard."""
        base = self.share.rank_shard * self.share.dup
        me = self.share.replica_index
        return [(base + s.replica, s) for s in self.segments if s.replica != me]


def striped_rows(share: RankShare, hashes: Sequence[bytes]) -> StripedRows:
    """The rows of ``share``'s pages for the blocks ``hashes`` (one chunk), by reader."""
    if share.dup == 1:
        return StripedRows(share, (Segment(0, 0, tuple(range(len(hashes)))),))
    by_replica: list[list[int]] = [[] for _ in range(share.dup)]
    for i, h in enumerate(hashes):
        by_replica[reader_replica(h, share.dup)].append(i)
    segments = []
    row = 0
    for replica, blocks in enumerate(by_replica):
        segments.append(Segment(replica, row, tuple(blocks)))
        row += len(blocks)
    return StripedRows(share, tuple(segments))


def pages_read(shares: Sequence[RankShare], hashes: Sequence[bytes]) -> int:
    """How many pages the rank holding ``shares`` reads from the store for ``hashes``
    in a striped load that succeeds (the figure the tests and the benchmark expect)."""
    return sum(len(striped_rows(share, hashes).mine.blocks) for share in shares)


def chunk_digest(hashes: Sequence[bytes]) -> int:
    """A 62-bit digest of a chunk's block hashes.

    Ranks compare it in the agreement of every chunk: a rank that is not loading the
    same blocks (an engine that skipped a call on one rank) is noticed there, before any
    byte is exchanged, instead of pairing its pages with another load's. 62 bits leave
    room to negate it in a signed 64-bit MIN reduction (:mod:`kvconn.group`).
    """
    digest = hashlib.blake2b(b"".join(hashes), digest_size=8, person=b"kvconn-chunk").digest()
    return int.from_bytes(digest, "little") >> 2
