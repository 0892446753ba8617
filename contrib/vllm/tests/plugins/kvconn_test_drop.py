"""A real third-party kvconn backend, found through its entry point, for the tests.

LMDB, with two ways for a test to remove a page while vLLM runs, each armed by a file
in the store directory (and disarmed when used):

* ``drop-next-load``: the next load first deletes the second page it asks for -- a
  page evicted between the scheduler's lookup and the worker's load, in vLLM's own
  worker process (under pipeline parallelism, the first stage's worker to load);
* ``fail-next-load``: the next load fails as a store that went away does (a
  ``BackendError``): that worker's connector serves without the store for its
  ``retry_interval_s``, while the scheduler's lookups still find every page;
* ``drop-at-lookup``, holding layer numbers (``0,2``): the next lookup first deletes
  the first page it asks for of the page kind that holds exactly those layers (found
  from the stored layout manifests) -- for a sliding-window group, the page of the
  prompt's first block, which falls outside the window of a longer hit; under pipeline
  parallelism, a page only the stage holding those layers has. ``0,2:last`` deletes
  the last page of that kind it asks for instead (a Mamba state at the hit's end), and
  ``0,2:-2`` the one before it (any index into the pages of that kind it asks for).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from kvconn_lmdb import LmdbBackend

from kvconn.backend import ReadStatus
from kvconn.errors import BackendError
from kvconn.keys import parse_key, parse_manifest_key
from kvconn.manifest import PageManifest

MARKER = "drop-next-load"
FAIL_MARKER = "fail-next-load"
LOOKUP_MARKER = "drop-at-lookup"


def _take(marker: Path) -> bool:
    """Disarm ``marker`` if it is armed; False if another process (a pipeline stage's
    worker) disarmed it first."""
    try:
        marker.unlink()
    except FileNotFoundError:
        return False
    return True


class DropOnLoadBackend(LmdbBackend):
    name = "lmdb-drop-on-load"

    def _drop_if_armed(self, keys: list[str]) -> None:
        if _take(self.path / FAIL_MARKER):
            raise BackendError(f"lmdb-drop-on-load: a failed load ({FAIL_MARKER})")
        if len(keys) > 1 and _take(self.path / MARKER):
            self._delete([keys[1]])

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        self._drop_if_armed(keys)
        return super()._get(keys, buffers, scratch=scratch)

    def _borrow(
        self, keys: list[str]
    ) -> contextlib.AbstractContextManager[list[memoryview | None]]:
        self._drop_if_armed(keys)  # loads from LMDB borrow the stored values
        return super()._borrow(keys)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        marker = self.path / LOOKUP_MARKER
        if marker.exists():
            numbers, _, which = marker.read_text().partition(":")
            kind = self._kind_of({int(n) for n in numbers.split(",")})
            index = -1 if which == "last" else int(which or 0)
            of_kind = [k for k in keys if (p := parse_key(k)) and (p.group, p.fingerprint) == kind]
            chosen = of_kind[index] if -len(of_kind) <= index < len(of_kind) else None
            if chosen is not None and _take(marker):
                self._delete([chosen])
        return super()._exists(keys)

    def _kind_of(self, layers: set[int]) -> tuple[int, str] | None:
        """The layer group and fingerprint of the page kind whose stored manifest names
        exactly ``layers``."""
        for key, size in list(self._list("")):
            parsed = parse_manifest_key(key)
            if parsed is None:
                continue
            buffer = bytearray(size)
            if self._get([key], [memoryview(buffer)], scratch=False)[0]:
                manifest = PageManifest.from_json(buffer)
                if {layer for layer, _, _ in manifest.regions} == layers:
                    return parsed.group, parsed.fingerprint
        return None


#: Seconds every put of ``lmdb-slow`` takes (its saves are still in flight when their
#: requests finish and vLLM hands their blocks to others).
SLOW_PUT_S = 0.3
SLOW_READ_S = 0.3
#: While this file exists in the store directory, every call of ``lmdb-stall`` hangs
#: (a server that accepts and never answers), up to ``STALL_S``.
STALL_MARKER = "stall"
STALL_S = 120.0


class SlowPutBackend(LmdbBackend):
    name = "lmdb-slow"

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        time.sleep(SLOW_PUT_S)
        return super()._put(keys, values)


class _OnRead(LmdbBackend):
    """LMDB that calls :meth:`_on_read` before every read of values, by whichever path
    a load takes: ``get``, ``read`` (striped loads) or borrowing stored values."""

    def _on_read(self, keys: list[str]) -> None:
        raise NotImplementedError

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        self._on_read(keys)
        return super()._get(keys, buffers, scratch=scratch)

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        self._on_read(keys)
        return super()._read_status(keys, buffers, scratch=scratch)

    def _borrow(
        self, keys: list[str]
    ) -> contextlib.AbstractContextManager[list[memoryview | None]]:
        self._on_read(keys)
        return super()._borrow(keys)


class SlowReadBackend(_OnRead):
    """LMDB whose every read of values takes ``SLOW_READ_S`` more: a load is still in
    flight when the requests that arrived with it are admitted."""

    name = "lmdb-slow-read"

    def _on_read(self, keys: list[str]) -> None:
        time.sleep(SLOW_READ_S)


class StallingBackend(LmdbBackend):
    name = "lmdb-stall"
    #: a stalled server, not a local store: the scheduler asks it under its deadline
    capabilities = dataclasses.replace(LmdbBackend.capabilities, local=False)

    def _stall(self) -> None:
        deadline = time.monotonic() + STALL_S
        while (self.path / STALL_MARKER).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        self._stall()
        return super()._exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        self._stall()
        return super()._put(keys, values)

    def _borrow(
        self, keys: list[str]
    ) -> contextlib.AbstractContextManager[list[memoryview | None]]:
        self._stall()
        return super()._borrow(keys)


#: The file of ``lmdb-count``, in the store directory: one line per read, the number of
#: pages it read, appended by every process that reads (each rank).
READS_LOG = "reads.log"


class CountingBackend(_OnRead):
    """LMDB that writes down how many pages each read asks for (striped reads ask for
    fewer: each shared page once per TP group)."""

    name = "lmdb-count"

    def _on_read(self, keys: list[str]) -> None:
        pages = sum(1 for k in keys if parse_key(k) is not None)
        if pages:
            with open(self.path / READS_LOG, "a") as fh:
                fh.write(f"{pages}\n")
