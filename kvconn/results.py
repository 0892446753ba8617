"""What a lookup, a save and a load report: plain data, free of torch.

A scheduler process that only asks lookups imports these without the tensor library, and
the asynchronous transfer service (:mod:`kvconn.transfer`) hands the same types back
when a transfer finishes, so a synchronous and an asynchronous caller read one result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Outcome(str, Enum):
    """What happened to one block of a transfer."""

    LOADED = "loaded"  # every page this rank needs is in its slots, verified
    FAILED = "failed"  # not loaded: recompute it (and every later block of the request)
    WRITTEN = "written"  # this rank stored at least one page of the block
    SKIPPED = "skipped"  # nothing to store: its pages were stored already, or not this rank's
    DROPPED = "dropped"  # a page of it could not be stored (backend down, put refused, full)


@dataclass(frozen=True)
class LookupResult:
    """The group-wide prefix hit: the same on every rank that asks at the same time."""

    blocks: int
    tokens: int
    available: bool = True  # False: the backend could not answer; the hit reads as 0
    #: Every hit length in blocks, ascending, when a sliding window is in effect: a
    #: windowed group may make ``N`` a hit but not ``N - 1`` (``blocks`` is the largest).
    #: ``None``: every length from 1 to ``blocks`` is a hit.
    restorable: tuple[int, ...] | None = None

    def prefixes(self) -> tuple[int, ...]:
        """Every hit length in blocks, ascending (``1 .. blocks`` without windows)."""
        if self.restorable is not None:
            return self.restorable
        return tuple(range(1, self.blocks + 1))


@dataclass(frozen=True)
class SaveResult:
    """Pages this rank wrote, found stored, or gave up; ``blocks``: one outcome per block."""

    written: int = 0  # pages this rank stored
    skipped: int = 0  # pages it owned but found already stored
    dropped: int = 0  # pages it owned but could not store (backend down, put refused, full)
    blocks: tuple[Outcome, ...] = ()

    @property
    def ok(self) -> bool:
        return self.dropped == 0


@dataclass(frozen=True)
class LoadResult:
    """``loaded`` leading blocks are in the pool; ``failed`` must be recomputed.

    Slots of failed blocks are left untouched by this load.
    """

    loaded: int
    failed: tuple[int, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def blocks(self) -> tuple[Outcome, ...]:
        return (Outcome.LOADED,) * self.loaded + (Outcome.FAILED,) * len(self.failed)


def save_outcomes(count: int, written: set[int], dropped: set[int]) -> tuple[Outcome, ...]:
    """Per block of a save: a dropped page makes the block dropped, else a written one
    makes it written; a block with neither was stored already or is not this rank's."""
    return tuple(
        Outcome.DROPPED if i in dropped else Outcome.WRITTEN if i in written else Outcome.SKIPPED
        for i in range(count)
    )
