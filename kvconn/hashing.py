"""The block hash chain: content addresses for full blocks of tokens.

``h_i = H(h_{i-1}, tokens of block i, extra_i)`` with ``h_{-1}`` derived from the reuse
scope. Chaining makes a block's address name its whole prefix, so equal addresses mean
equal KV bytes. blake2b is used instead of Python's ``hash()`` because every process on
every machine must agree, and because a collision would serve another request's bytes.

Engines that already hash their blocks (vLLM's 32-byte digests, SGLang's sha256 hex
strings) keep their own chain: :func:`adopt_hashes` maps each engine hash, tagged with
the name of the scheme that made it, to a kvconn digest of the usual size.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvconn.errors import ArgumentError, ConfigError, InvalidKeyError

DIGEST_SIZE = 16
_VERSION = b"kvconn.chain.v1"


def _field(data: bytes) -> bytes:
    # Length-prefixed, so that ("ab", "c") and ("a", "bc") never hash alike.
    return len(data).to_bytes(8, "little") + data


def _as_bytes(value: bytes | str) -> bytes:
    # Surrogate escapes (text read from argv or the environment under a C locale) are
    # turned back into the bytes that were typed, so such a salt hashes as it would
    # have under a UTF-8 locale; a text that cannot be encoded at all is refused.
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)


@dataclass(frozen=True)
class ReuseScope:
    """What must match, besides the tokens, for two requests to share KV bytes.

    ``cache_salt`` isolates tenants; ``lora_id`` separates adapters (their KV differs);
    ``mm_digests`` are digests of multimodal inputs whose placeholder tokens look alike.
    """

    cache_salt: str = ""
    lora_id: str | None = None
    mm_digests: tuple[bytes | str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.cache_salt, str):
            raise ArgumentError(f"ReuseScope: cache_salt must be a str, got {self.cache_salt!r}")
        if self.lora_id is not None and not isinstance(self.lora_id, str):
            raise ArgumentError(
                f"ReuseScope: lora_id must be a str or None (e.g. str(lora_int_id)), "
                f"got {self.lora_id!r}"
            )
        # A lone string would iterate as one "digest" per character: 'abc' is one digest.
        digests = self.mm_digests
        if isinstance(digests, (str, bytes, bytearray)) or not isinstance(digests, (list, tuple)):
            raise ArgumentError(
                f"ReuseScope: mm_digests must be a tuple of digests (bytes or str), "
                f"got {digests!r:.80}"
            )
        for digest in digests:
            if not isinstance(digest, (bytes, str)):
                raise ArgumentError(
                    f"ReuseScope: each of mm_digests must be bytes or str, got {digest!r:.80}"
                )
        object.__setattr__(self, "mm_digests", tuple(digests))
        texts = [self.cache_salt, self.lora_id or "", *(d for d in digests if isinstance(d, str))]
        for text in texts:
            try:
                _as_bytes(text)
            except UnicodeEncodeError:
                raise ArgumentError(f"ReuseScope: {text!r:.80} is not encodable text") from None

    def seed(self) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvconn-scope")
        h.update(_VERSION)
        h.update(_field(_as_bytes(self.cache_salt)))
        h.update(_field(b"" if self.lora_id is None else b"L" + _as_bytes(self.lora_id)))
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
    if (
        isinstance(tokens_per_block, bool)
        or not isinstance(tokens_per_block, int)
        or tokens_per_block < 1
    ):
        raise ArgumentError(f"tokens_per_block must be an int >= 1, got {tokens_per_block!r}")
    if hasattr(tokens, "tolist"):  # a tensor or an array
        tokens = tokens.tolist()
    # Bytes would pass as tokens, 8 bytes per token id (array.array reads them raw).
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise ArgumentError(f"tokens must be a sequence of token ids, got {tokens!r:.80}")
    if scope is not None and not isinstance(scope, ReuseScope):
        raise ArgumentError(f"scope must be a ReuseScope or None, got {scope!r:.80}")
    n = len(tokens) // tokens_per_block
    if extras is not None:
        if isinstance(extras, (str, bytes)) or not isinstance(extras, Sequence):
            raise ArgumentError(f"extras must be a sequence of bytes, got {extras!r:.80}")
        if len(extras) < n:
            raise ArgumentError(f"extras has {len(extras)} entries for {n} full blocks")
        for i, extra in enumerate(extras[:n]):
            if not isinstance(extra, (bytes, bytearray)):
                raise ArgumentError(f"extras[{i}] must be bytes, got {extra!r:.80}")
    parent = (scope or ReuseScope()).seed()
    out: list[bytes] = []
    i = 0
    try:
        for i in range(n):
            chunk = tokens[i * tokens_per_block : (i + 1) * tokens_per_block]
            parent = hash_block(parent, chunk, extras[i] if extras is not None else b"")
            out.append(parent)
    except (TypeError, OverflowError):
        chunk = tokens[i * tokens_per_block : (i + 1) * tokens_per_block]
        raise ArgumentError(
            f"tokens must be integer ids that fit 64 bits; block {i} holds {list(chunk)!r:.120}"
        ) from None
    return out


#: A hash scheme names the engine and algorithm that made a hash, e.g. ``vllm:sha256``.
_SCHEME = re.compile(r"^[a-z0-9][a-z0-9._:+-]{0,63}$")
#: The shortest engine hash accepted: below 64 bits, unrelated prefixes would collide in
#: a store of realistic size, and a collision serves another request's KV bytes.
MIN_ENGINE_HASH_BYTES = 8


def check_scheme(scheme: str) -> str:
    """``scheme`` if it is a usable hash-scheme name, else a :class:`ConfigError`."""
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise ConfigError(
            f"hash scheme {scheme!r} must be 1-64 characters of a-z, 0-9 and '._:+-', "
            "naming the engine and its algorithm (e.g. 'vllm:sha256')"
        )
    if scheme == "kvconn" or scheme.startswith("kvconn:"):
        raise ConfigError(f"hash scheme {scheme!r} is reserved for kvconn's own chain")
    return scheme


def adopt_hash(scheme: str, engine_hash: bytes | str) -> bytes:
    """The kvconn block digest standing for one engine-made block hash.

    The engine hash is not truncated: a keyed blake2b of (scheme, kind, the whole hash)
    maps it to :data:`DIGEST_SIZE` bytes. Its personalisation differs from the chain's,
    and the scheme is hashed in, so an adopted hash never equals a digest of kvconn's own
    chain or one adopted from another scheme, unless blake2b-128 collides. Keys thus keep
    one fixed length whatever the engine's hash size (backends limit keys to 250
    characters), and, being a pure function, every rank and the scheduler agree.

    Bytes are taken as they are; a string (SGLang's hex digests) as its UTF-8 text, tagged
    apart from bytes so that ``b"ab"`` and ``"ab"`` never share an address.
    """
    return _adopt(check_scheme(scheme).encode(), engine_hash, 0)


def adopt_hashes(scheme: str, engine_hashes: Sequence[bytes | str]) -> list[bytes]:
    """:func:`adopt_hash` over a request's block hashes, in order."""
    tag = check_scheme(scheme).encode()
    if isinstance(engine_hashes, (str, bytes, bytearray)):
        raise InvalidKeyError("engine hashes must be a sequence of hashes, not a single hash")
    return [_adopt(tag, h, i) for i, h in enumerate(engine_hashes)]


def _adopt(tag: bytes, engine_hash: bytes | str, index: int) -> bytes:
    if isinstance(engine_hash, str):
        kind, data = b"s", engine_hash.encode("utf-8")
    elif isinstance(engine_hash, (bytes, bytearray, memoryview)):
        kind, data = b"b", bytes(engine_hash)
    else:
        raise InvalidKeyError(
            f"engine block hash {index} must be bytes or str, got {type(engine_hash).__name__}"
        )
    if len(data) < MIN_ENGINE_HASH_BYTES:
        raise InvalidKeyError(
            f"engine block hash {index} has {len(data)} bytes; at least "
            f"{MIN_ENGINE_HASH_BYTES} are needed for addresses that do not collide"
        )
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvconn-engine")
    h.update(_field(tag))
    h.update(_field(kind + data))
    return h.digest()
