"""A chunk's load from values the store lends: each page verified, then scattered at once.

A store that holds values in this process's memory (LMDB's map; the replies redis-py has
just parsed) lends them (``Backend.borrow``), so a load needs no staging copy. Verifying
every page of a chunk and only then scattering them reads each page twice from memory: a
chunk is tens of MiB, far more than a core's cache, so by the time the scatter reaches a
page the checksum pass has pushed it out. Here each block's pages are verified and, if
the block may load, scattered straight after, while the page is still in cache: the
second read costs little, and a verified load moves about one copy of the bytes plus the
checksum (``benchmarks/bench_lmdb.py``: "load (b)" against "load (b')").

The rule stays the one every load follows (the connector's rule 5): a block loads only
if every page it needs arrived whole and passed its checksum, the first block that did
not ends the load, and no later block is written. Each block is scattered under the
caller's gate, so a load the engine gave up on writes nothing more from then on.

Pure of backend calls, like :func:`kvconn.repair.check`: it runs while the store lends
the bytes, and the caller repairs the store (the ``Verdict``) after the loan ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvconn.backend import ReadStatus
from kvconn.gate import Gate
from kvconn.movement import PageMover
from kvconn.plan import RankShare
from kvconn.repair import Verdict, read_verdict


def lent_statuses(views: Sequence[memoryview | None], sizes: Sequence[int]) -> list[ReadStatus]:
    """Per lent value, whether it is a page of its kind's size (``None``: not stored)."""
    return [
        ReadStatus.MISSING
        if view is None
        else ReadStatus.LOADED
        if view.nbytes == size
        else ReadStatus.WRONG_SIZE
        for view, size in zip(views, sizes)
    ]


def verify_and_scatter(
    shares: Sequence[RankShare],
    keys: Sequence[str],
    views: Sequence[memoryview | None],
    statuses: Sequence[ReadStatus],
    wanted: Sequence[Sequence[int]],
    blocks: int,
    slots: Sequence[Sequence[int]],
    movers: Sequence[PageMover],
    gate: Gate | None,
) -> tuple[Verdict, int, list[int]]:
    """Load a chunk of ``blocks`` blocks from lent ``views``, block by block.

    Pages come kind by kind, as read: kind ``s`` (``shares[s]``) has one page per block
    in ``wanted[s]`` (ascending), to be written into slot ``slots[s][block]``.

    Returns the verdict on every page that arrived (after a failed page, the pages not
    reached are still verified, so the store is repaired of each damaged one), how many
    blocks were scattered, and how many pages of each kind.
    """
    plans = [share.plan for share, got in zip(shares, wanted) for _ in got]
    empty = memoryview(b"")
    pages = [
        v if v is not None and s is ReadStatus.LOADED else empty for v, s in zip(views, statuses)
    ]
    verdict = read_verdict(plans, keys, statuses)
    verified = [False] * len(pages)

    def passes(i: int) -> bool:
        if not verified[i] and verdict.usable[i]:
            verified[i] = True
            if not plans[i].checksum.verify([pages[i]], [keys[i]])[0]:
                verdict.usable[i] = False
                verdict.damaged[keys[i]] = plans[i]
        return verdict.usable[i]

    # per kind, block -> index of its page among the views
    page_at: list[dict[int, int]] = []
    pos = 0
    for got in wanted:
        page_at.append({block: pos + k for k, block in enumerate(got)})
        pos += len(got)
    scattered = [0] * len(wanted)
    good = 0
    cancelled = False
    for block in range(blocks):
        here = [(s, at[block]) for s, at in enumerate(page_at) if block in at]
        if not all(passes(i) for _, i in here):
            break
        with gate(1) if gate is not None else contextlib.nullcontext(True) as allowed:
            if not allowed:
                cancelled = True
                break
            for s, i in here:
                movers[s].scatter_page(slots[s][block], pages[i])
                scattered[s] += 1
        good = block + 1
    if good < blocks and not cancelled:
        for i in range(len(pages)):
            passes(i)
    return verdict, good, scattered
