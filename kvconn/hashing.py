"""The block hash chain: content addresses for full blocks of tokens.

``h_i = H(h_{i-1}, tokens of block i, extra_i)`` with ``h_{-1}`` derived from the reuse
scope. Chaining makes a block's address name its whole prefix, so equal addresses mean
equal KV bytes. blake2b is used instead of Python's ``hash()`` because every process on
every machine must agree, and because a collision would serve another request's bytes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvconn.errors import ConfigError

DIGEST_SIZE = 16
_VERSION = b"kvconn.chain.v1"


def _field(data: bytes) -> bytes:
    # Length-prefixed, so that ("ab", "c") and ("a", "bc") never hash alike.
    return len(data).to_bytes(8, "little") + data


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


@dataclass(frozen=True)
class ReuseScope:
    """What must match, besides the tokens, for two requests to share KV bytes.

    ``cache_salt`` isolates tenants; ``lora_id`` separates adapters (their KV differs);
    ``mm_digests`` are digests of multimodal inputs whose placeholder tokens look alike.
    """

    cache_salt: str = ""
    lora_id: str | None = None
    mm_digests: tuple[bytes | str, ...] = ()

    def seed(self) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvconn-scope")
        h.update(_VERSION)
        h.update(_field(self.cache_salt.encode()))
        h.update(_field(b"" if self.lora_id is None else b"L" + self.lora_id.encode()))
        h.update(len(self.mm_digests).to_bytes(8, "little"))
        for digest in self.mm_digests:
            h.update(_field(_as_bytes(digest)))
        return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("q", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The address of one block given its parent's address."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvconn-block")
    h.update(_field(parent))
    h.update(_field(_token_bytes(tokens)))
    h.update(_field(extra))
    return h.digest()


def block_hashes(
    tokens: Sequence[int],
    tokens_per_block: int,
    scope: ReuseScope | None = None,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Addresses of every *full* block of ``tokens``; a partial tail is never stored.

    ``extras[i]`` (optional) is mixed into block ``i`` only, e.g. the digest of an image
    whose placeholder tokens fall in that block.
    """
    if tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    n = len(tokens) // tokens_per_block
    if extras is not None and len(extras) < n:
        raise ConfigError(f"extras has {len(extras)} entries for {n} full blocks")
    parent = (scope or ReuseScope()).seed()
    out: list[bytes] = []
    for i in range(n):
        chunk = tokens[i * tokens_per_block : (i + 1) * tokens_per_block]
        parent = hash_block(parent, chunk, extras[i] if extras is not None else b"")
        out.append(parent)
    return out
