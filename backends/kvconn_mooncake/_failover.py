"""The fail-over policy: what to do with a key whose copy sits on a dead storage process.

Measured with ``mooncake-transfer-engine`` 0.3.13 (``docs/notes/mooncake-api.md``): when
a storage process dies, the master keeps its segment for ``client_ttl`` (10 s by
default). Meanwhile ``batch_get_into`` keeps choosing the dead replica of an object that
has a live one too: every such key fails with ``-800`` after a ~0.5 s connect timeout,
call after call, so ``replica_num=2`` protected nothing during that window. Puts the
master places on the dead segment fail the same way (``-800``, the key stays absent).

This module only decides; the layer that runs the batches asks it about each key that
failed and carries the answer out (reads another copy with
:class:`~kvconn_mooncake._replicas.ReplicaReader`, counts, records the key's status,
puts again). Its answers are data, and it calls nothing of the layers above it:

* a read whose transfer failed (:func:`after_failed_transfer`) or whose copies were
  just described (:func:`after_description`) gets a :class:`Verdict`: read another
  copy, or the key's final status, with the endpoints its only copy failed on, to be
  avoided from then on;
* a read whose copies lie partly on an endpoint known to fail skips the client, which
  might pick that copy, and goes straight to a live copy (:func:`bypass_client`);
* puts that failed with ``-800`` are put once more preferring the segments that took
  the batch's other keys, or a recent batch's; with neither, once where the master
  chooses, and the rest then where those landed; while a reroute is recent, new
  batches prefer its live segments from the start (:class:`Reroute`).

Keys whose only copy is gone, or every copy, read ``UNREACHABLE``: a failed load that
the engine recomputes, of a page that is kept (its bytes are not at fault; another copy
or the master dropping the dead segment settles it).

Threads: the functions are pure; each piece of :class:`Reroute`'s state is replaced
whole and read once, so threads never mix two answers (its turn counter is an
``itertools.count``, whose ``next`` is atomic).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvconn.backend import ReadStatus
from kvconn_mooncake import _codes as codes
from kvconn_mooncake._replicas import AVOID_S, Stored

#: Keys of a batch whose copies are asked for to learn which segments are alive: a few
#: suffice (each names its segment), and the question costs one RPC whatever it asks.
WITNESSES = 8

#: Keys put where the master chooses that must land nowhere, in a row, before such puts
#: are judged futile. One key landing on the dead process of two is a coin toss, not
#: evidence; eight in a row happen by chance once in 256 with one replica on two
#: segments, and every time when each placement needs the dead process.
FUTILE_MISSES = 8


@dataclass(frozen=True, slots=True)
class Verdict:
    """The policy's answer for one key whose read failed.

    ``status`` None: read the key from another of its copies. Otherwise the key's
    outcome, and ``dead``: the endpoints of its only copy, which failed, so that keys
    with a copy there and another elsewhere are read from the other from now on.
    """

    status: ReadStatus | None
    dead: tuple[str, ...] = ()

    @property
    def retry(self) -> bool:
        return self.status is None


#: Read the key from another copy.
RETRY = Verdict(None)


def after_failed_transfer(stored: Stored | None) -> Verdict:
    """A read through the client failed to transfer (``-800``).

    The chosen copy's process is gone but the master still lists it. With copies not
    yet known (a read that skipped the size query) or more than one, try the others.
    With one, there is nothing to fail over to: the key is ``UNREACHABLE`` and its
    endpoint dead.
    """
    if stored is None or len(stored.copies) > 1:
        return RETRY
    return Verdict(ReadStatus.UNREACHABLE, _endpoints(stored))


def after_description(stored: Stored | None, size: int) -> Verdict:
    """A read that failed unchecked, once its copies were described.

    The description tells what the failed transfer could not: gone since
    (``MISSING``), of another size than the ``size`` wanted (``WRONG_SIZE``), or stored
    with no other copy to try (``UNREACHABLE``).
    """
    if stored is None:
        return Verdict(ReadStatus.MISSING)
    if stored.size != size:
        return Verdict(ReadStatus.WRONG_SIZE)
    if len(stored.copies) > 1:
        return RETRY
    return Verdict(ReadStatus.UNREACHABLE, _endpoints(stored))


def bypass_client(stored: Stored, avoid: set[str]) -> bool:
    """True when the client might pick a copy known to fail while another is live."""
    if not avoid or len(stored.copies) < 2:
        return False
    endpoints = {c.endpoint for c in stored.copies}
    return bool(endpoints & avoid) and bool(endpoints - avoid)


def _endpoints(stored: Stored) -> tuple[str, ...]:
    return tuple(c.endpoint for c in stored.copies)


class Reroute:
    """Where to put again the keys the master placed on a dead storage process.

    Until the master drops a dead process's segment (``client_ttl``) it keeps placing
    new objects there; their transfer fails (``-800``) and the key stays absent. The
    segments that took this batch's other keys (or, when none landed, a recent
    batch's) are alive, so the failed keys are put once more preferring those
    (``preferred_segments``, a hint: a wrong guess only means a random placement
    again). Measured with one of two storage processes killed: about half a batch
    failed, every retried key was stored. A batch none of whose keys landed, in a
    client that has seen no batch land lately, knows no live segment: it is put again
    once where the master chooses, and whatever lands there witnesses for the rest.
    With ``replica_num`` 2 and two segments every put needs the dead one: nothing
    lands, the second placement neither, and once :data:`FUTILE_MISSES` keys in a row
    have landed nowhere so, no batch is placed anywhere again for ``remember_s``
    (:meth:`place_anywhere`). Once a reroute has seen live segments,
    new batches prefer them from their first put for ``remember_s`` (:meth:`steer`).

    The master puts a batch's keys on the first preferred segment with room (measured
    on 0.3.13: with three live segments preferred, 288 keys of 288 on the first), so
    every answer names the segments in a new order, turn by turn from a random start:
    batch after batch, writes spread over the live segments as free placement spreads
    them, instead of filling one for ``remember_s``.
    """

    def __init__(self, remember_s: float = AVOID_S) -> None:
        self.remember_s = remember_s
        #: Segments puts landed on lately, and until when to trust that. Threads replace
        #: the pair whole and read it once, so they never mix two.
        self._live: tuple[list[str], float] = ([], 0.0)
        #: Keys put where the master chose that landed nowhere in a row, and when the
        #: last of them failed; replaced whole like ``_live``.
        self._anywhere: tuple[int, float] = (0, 0.0)
        #: Which live segment the next answer names first (``next`` is atomic).
        self._turn = itertools.count(random.randrange(1 << 16))

    @staticmethod
    def failed(results: Sequence[int]) -> list[int]:
        """Positions of the keys whose put to be retried: their transfer failed."""
        return [i for i, code in enumerate(results) if code == codes.TRANSFER_FAIL]

    @staticmethod
    def witnesses(keys: Sequence[str], results: Sequence[int]) -> list[str]:
        """Keys of the batch that landed, whose copies show which segments are alive."""
        return [k for k, code in zip(keys, results) if code in codes.PRESENT][:WITNESSES]

    def segments(self, seen: Iterable[str], avoid: set[str]) -> list[str]:
        """The segments to prefer: ``seen`` holding the witnesses' copies, else recent ones.

        ``seen`` is remembered for ``remember_s``, so a batch none of whose keys landed
        can use the last answer. Endpoints a read found dead (``avoid``) are left out: a
        key that was already stored, answered as landed, may have its copy on the dead
        one. Empty: nothing is known alive, no segment to prefer.
        """
        live = sorted(set(seen))
        if not live:
            return self.steer(avoid)
        self._live = (live, time.monotonic() + self.remember_s)
        return self._in_turn([endpoint for endpoint in live if endpoint not in avoid])

    def steer(self, avoid: set[str]) -> list[str]:
        """The segments a batch's first put prefers: those seen alive since a put
        failed, while remembered, less ``avoid``. Empty (no death seen lately): the
        master places freely.

        A first put the master places on the dead process waits out a transfer timeout
        (~1 s measured, for every batch after the first) before it is rerouted; steered,
        the batches after a reroute land at once for as long as the death is recent.
        """
        recent, until = self._live
        if until <= time.monotonic():
            return []
        return self._in_turn([endpoint for endpoint in recent if endpoint not in avoid])

    def _in_turn(self, segments: list[str]) -> list[str]:
        """``segments`` rotated to start at the next one in turn."""
        if len(segments) < 2:
            return segments
        first = next(self._turn) % len(segments)
        return segments[first:] + segments[:first]

    def forget(self) -> None:
        """Drop the segments remembered alive: a put steered to them landed nowhere."""
        self._live = ([], 0.0)

    def place_anywhere(self) -> bool:
        """Whether to put a batch that knows no live segment again where the master
        chooses. Not for ``remember_s`` after :data:`FUTILE_MISSES` keys in a row landed
        nowhere there: with ``replica_num`` 2 on two segments every placement needs the
        dead process, and each try waits out a transfer timeout (measured ~1 s) to fail
        again. Fewer misses are chance (a 1-key batch lands on the dead process of two
        half the time) and turn nothing off."""
        misses, last = self._anywhere
        return misses < FUTILE_MISSES or time.monotonic() >= last + self.remember_s

    def placed_anywhere(self, tried: int, landed: int) -> None:
        """Record how a put of ``tried`` keys where the master chose went: ``landed`` of
        them were stored. Misses older than ``remember_s`` no longer count. Threads may
        lose one another's count (read, then replaced whole): a miss more or less."""
        now = time.monotonic()
        misses, last = self._anywhere
        if landed or now >= last + self.remember_s:
            misses = 0
        self._anywhere = (0 if landed else misses + tried, now)
