"""A chunk's load from values the store lends: a few blocks verified, then scattered at once.

A store that holds values in this process's memory (LMDB's map; the replies redis-py has
just parsed) lends them (``Backend.borrow``), so a load needs no staging copy. Verifying
every page of a chunk and only then scattering them reads each page twice from memory: a
chunk is tens of MiB, far more than a core's cache, so by the time the scatter reaches a
page the checksum pass has pushed it out. Here the chunk goes in groups of a few MiB
(``GROUP_BYTES``): a group's pages are verified and the blocks that may load scattered
straight after, while the pages are still in cache, so a verified load moves about one
copy of the bytes plus the checksum (``benchmarks/bench_lmdb.py``: "load (b)" against
"load (b')").

Each group's checksums are one call and its scatter another, each letting the GIL go
once (``kvconn._checksum``, ``kvconn._scatter``): beside an engine thread that holds the
GIL, every release costs up to the interpreter's switch interval to win back, and a
release per page's checksum and per page's scatter made that 126 waits for a 63-block
load (``benchmarks/bench_load.py --hog``).

The rule stays the one every load follows (the connector's rule 5): a block loads only
if every page it needs arrived whole and passed its checksum, the first block that did
not ends the load, and no later block is written. Each group's blocks are scattered
under the caller's gate, so a load the engine gave up on writes nothing more from then
on; a give-up waits at most for one group's scatter.

Pure of backend calls, like :func:`kvconn.repair.check`: it runs while the store lends
the bytes, and the caller repairs the store (the ``Verdict``) after the loan ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvconn.backend import ReadStatus
from kvconn.gate import Gate
from kvconn.integrity import PageChecksum
from kvconn.movement import PageMover, scatter_host_pages
from kvconn.plan import RankShare
from kvconn.repair import Verdict, read_verdict

#: Bytes of lent pages verified and then scattered together: enough that a load lets the
#: GIL go a few times per ten MiB, few enough that the pages stay in cache between the
#: two passes and that a give-up waits for little.
GROUP_BYTES = 4 << 20


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
    """Load a chunk of ``blocks`` blocks from lent ``views``, a group of blocks at a time.

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

    def check(indices: Sequence[int]) -> None:
        """Verify the pages at ``indices`` not verified yet, one batch per scheme."""
        todo: dict[PageChecksum, list[int]] = {}
        for i in indices:
            if not verified[i] and verdict.usable[i]:
                verified[i] = True
                todo.setdefault(plans[i].checksum, []).append(i)
        for checksum, got in todo.items():
            passed = checksum.verify([pages[i] for i in got], [keys[i] for i in got])
            for i, ok in zip(got, passed):
                if not ok:
                    verdict.usable[i] = False
                    verdict.damaged[keys[i]] = plans[i]

    # per block, (kind, index of its page among the views) for each kind it has a page of
    here: list[list[tuple[int, int]]] = [[] for _ in range(blocks)]
    pos = 0
    for s, got in enumerate(wanted):
        for k, block in enumerate(got):
            here[block].append((s, pos + k))
        pos += len(got)
    scattered = [0] * len(wanted)
    good = 0
    cancelled = False
    while good < blocks:
        end, size = good, 0
        while end < blocks and (end == good or size < GROUP_BYTES):
            size += sum(pages[i].nbytes for _, i in here[end])
            end += 1
        check([i for block in range(good, end) for _, i in here[block]])
        ready = good
        while ready < end and all(verdict.usable[i] for _, i in here[ready]):
            ready += 1
        if ready > good:
            with gate(ready - good) if gate is not None else contextlib.nullcontext(True) as ok:
                if not ok:
                    cancelled = True
                    break
                scatter_host_pages(
                    [
                        movers[s].host_page(slots[s][block], pages[i])
                        for block in range(good, ready)
                        for s, i in here[block]
                    ]
                )
            for block in range(good, ready):
                for s, _ in here[block]:
                    scattered[s] += 1
            good = ready
        if ready < end:
            break
    if good < blocks and not cancelled:
        check(range(len(pages)))
    return verdict, good, scattered
