"""Mooncake Store result codes and what each means for kvconn's contract.

The Python client reports failures as negative integers (``ErrorCode`` in
``mooncake-store/include/types.h``), not exceptions. The contract needs three answers
per key, so every code is sorted here once:

* *absent* (a miss, a read of a put still in flight, a replica gone): ``get`` → False;
* *this key failed* (no space, a dead storage segment): ``put``/``get`` → False, the
  connector counts a dropped save or a failed load and serves on;
* *the store could not answer* (master unreachable, client broken): raise — a miss
  must never be reported for a store that was not asked.

Values were observed with mooncake-transfer-engine 0.3.13 (``docs/notes/mooncake-api.md``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvconn.errors import BackendError, BackendUnavailable

OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
SEGMENT_NOT_FOUND = -101
CLIENT_NOT_FOUND = -103
NO_AVAILABLE_HANDLE = -200  # no space: the store is full, a dropped save, not a fault
INVALID_KEY = -400
WRITE_FAIL = -500
INVALID_PARAMS = -600  # also: a buffer smaller than the value (nothing written)
ILLEGAL_CLIENT = -601
INVALID_WRITE = -700
INVALID_READ = -701
REPLICA_IS_NOT_READY = -703  # a put in flight: exists reads 0, reads get this
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
REPLICA_NOT_FOUND = -710
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800  # the segment holding the replica belongs to a dead process
RPC_FAIL = -900  # the master did not answer
UNAVAILABLE_IN_CURRENT_STATUS = -1010
UNAVAILABLE_IN_CURRENT_MODE = -1011

#: Each code's name, for messages: every upper-case int above, so none is forgotten.
NAMES: dict[int, str] = {
    code: name for name, code in globals().items() if name.isupper() and type(code) is int
}

#: The master cannot be reached or is not serving: the whole call failed, may recover.
UNAVAILABLE = frozenset({RPC_FAIL, UNAVAILABLE_IN_CURRENT_STATUS, UNAVAILABLE_IN_CURRENT_MODE})
#: The client itself is broken or misused: no per-key answer is trustworthy.
BROKEN = frozenset({INTERNAL_ERROR, CLIENT_NOT_FOUND, ILLEGAL_CLIENT, INVALID_KEY})
#: A read that finds nothing complete to read: a miss, never a partial value.
ABSENT = frozenset(
    {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE, LEASE_EXPIRED}
)
#: A put that stored nothing because there is no room: a dropped save.
FULL = frozenset({NO_AVAILABLE_HANDLE})
#: A put that found the key already there (or being written): first writer wins.
PRESENT = frozenset({OK, OBJECT_ALREADY_EXISTS})


def describe(code: int) -> str:
    return f"{code} ({NAMES.get(code, 'unknown code')})"


def raise_for_store_failure(codes: Iterable[int], op: str, where: str) -> None:
    """Raise when any code says the store, not a key, failed (``-900`` and the like).

    One such code fails the whole batch: the master answered none of it reliably, and a
    partial answer would let "could not ask" pass for "absent".
    """
    worst = None
    for code in codes:
        if code in UNAVAILABLE:
            raise BackendUnavailable(
                f"mooncake at {where}: {op} failed with {describe(code)}; the master is "
                "unreachable or not serving"
            )
        if code in BROKEN and worst is None:
            worst = code
    if worst is not None:
        raise BackendError(f"mooncake at {where}: {op} failed with {describe(worst)}")
