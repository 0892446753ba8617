"""Page checksums: a trailer after each stored page, seeded by the page's key.

A store can hand back the right number of wrong bytes: a scribbled LMDB file, a garbled
Redis value, a bad disk or DIMM under a Mooncake segment. Sizes alone do not catch that,
and wrong KV bytes are not a crash but silently wrong output. So every stored value is
the page followed by a checksum of it, verified on load before any byte reaches a pool
slot; a page that fails is a failed page, like a missing one.

The checksum is seeded from the page's key, so a value stored or returned under another
key (a store that mixes up keys, a copy restored to the wrong place) fails as well.

xxh3-64 (the ``xxhash`` package, a thin binding of the reference C library) runs at
memory speed: a checksum costs about one more read of the page, against a transfer
that moves it at least twice (gather + put, get + scatter). ``docs/performance.md``
gives the measured cost per backend. ``none`` stores bare pages, for deployments that
trust their store and want that read back; the scheme is part of every page's
fingerprint, so pages of the two schemes never meet (each reads the other's as misses).

A batch of pages is sealed or verified in one call that lets the GIL go once
(``kvconn._checksum``), with the xxh3 function of the library the ``xxhash`` package
already loaded, once it agrees with the package's own digests (:func:`native`); the
package computes them one call per page otherwise, which gives the GIL up once per page.
The trailers are the same either way.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvconn.errors import ConfigError

XXH3_64 = "xxh3-64"
NONE = "none"

#: Trailer bytes of each scheme, by name.
SCHEMES = {XXH3_64: 8, NONE: 0}
DEFAULT = XXH3_64


@dataclass(frozen=True)
class PageChecksum:
    """One checksum scheme: how many bytes follow each page, and how they are made.

    A stored value is ``payload + trailer``; ``seal`` writes the trailer of a value whose
    payload is in place, ``verify`` checks one.
    """

    name: str = DEFAULT

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in SCHEMES:
            raise ConfigError(
                f"unknown checksum {self.name!r}; choose one of: {', '.join(SCHEMES)}"
            )

    @property
    def size(self) -> int:
        """Bytes of the trailer after each page."""
        return SCHEMES[self.name]

    def seal(self, values: Sequence[memoryview], keys: Sequence[str]) -> None:
        """Write the trailer of each value (``payload + trailer``) for its key."""
        if not self.size:
            return
        fast = native()
        if fast is not None:
            fast.seal(values, keys)
            return
        digest = xxhash.xxh3_64_digest
        seed = xxhash.xxh3_64_intdigest
        for value, key in zip(values, keys):
            value[-8:] = digest(value[:-8], seed=seed(key.encode()))

    def verify(self, values: Sequence[memoryview], keys: Sequence[str]) -> list[bool]:
        """Per value, whether its trailer is the checksum of its payload under its key."""
        if not self.size:
            return [True] * len(values)
        fast = native()
        if fast is not None:
            return fast.verify(values, keys)
        digest = xxhash.xxh3_64_digest
        seed = xxhash.xxh3_64_intdigest
        return [
            value[-8:] == digest(value[:-8], seed=seed(key.encode()))
            for value, key in zip(values, keys)
        ]


class _Batches(Protocol):
    """What :func:`native` hands out: ``kvconn._checksum``, bound."""

    def digest(self, data: bytes, seed: int, /) -> int: ...
    def seal(self, values: Sequence[memoryview], keys: Sequence[str], /) -> None: ...
    def verify(self, values: Sequence[memoryview], keys: Sequence[str], /) -> list[bool]: ...


#: Set (to anything) to keep checksums in the ``xxhash`` package, one call per page.
NO_NATIVE_ENV = "KVCONN_NO_NATIVE_CHECKSUM"


@functools.cache
def native() -> _Batches | None:
    """``kvconn._checksum`` bound to a working xxh3, or ``None`` to use the package.

    The function comes from the ``xxhash`` package's own extension (which exports the
    reference library's symbols) or else the system's ``libxxhash.so.0``, and must give
    the package's digests on inputs around xxh3's internal size steps, seeded and not:
    a library of another xxh3 version or ABI is never used to write or judge a trailer.
    """
    if os.environ.get(NO_NATIVE_ENV):
        return None
    try:
        from kvconn import _checksum
    except ImportError:  # a source tree whose extensions were never built
        return None
    extension = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    for library in (extension, "libxxhash.so.0"):
        if library and _checksum.bind(library) and _agrees(_checksum):
            return _checksum
    _checksum.unbind()
    return None


def _agrees(module: _Batches) -> bool:
    """Whether the bound xxh3 gives the package's digests (sizes around 16, 128, 240
    bytes and a stripe block, where xxh3 changes how it hashes)."""
    data = bytes(range(256)) * 40
    for size in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 10240):
        for seed in (0, 0x9E3779B97F4A7C15):
            if module.digest(data[:size], seed) != xxhash.xxh3_64_intdigest(data[:size], seed):
                return False
    return True
