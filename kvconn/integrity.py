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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        digest = xxhash.xxh3_64_digest
        seed = xxhash.xxh3_64_intdigest
        for value, key in zip(values, keys):
            value[-8:] = digest(value[:-8], seed=seed(key.encode()))

    def verify(self, values: Sequence[memoryview], keys: Sequence[str]) -> list[bool]:
        """Per value, whether its trailer is the checksum of its payload under its key."""
        if not self.size:
            return [True] * len(values)
        digest = xxhash.xxh3_64_digest
        seed = xxhash.xxh3_64_intdigest
        return [
            value[-8:] == digest(value[:-8], seed=seed(key.encode()))
            for value, key in zip(values, keys)
        ]
