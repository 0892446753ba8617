"""Page keys: pure functions, so the key form can be tested without any store.

Page keys: ``{namespace}/{model}/{shard}/lg{group}/{fingerprint}/{block hash hex}``.

Every part that can change what the stored bytes mean is in the key — the model
revision, the shard, the layer group and a fingerprint of the page's geometry and role
composition — so a reader with another layout computes another key and misses; it can
never receive bytes it would misinterpret.

Layout manifests: ``{namespace}/{model}/_layout/lg{group}/{fingerprint}``, one per page
kind, whose value describes in JSON what the fingerprint hashes (roles, dtypes, sizes),
so a tool that only sees keys can tell which roles a page holds. The two forms never
collide: a manifest key has five segments and ``_layout`` in the shard position, where
a page key has six and ``replicated`` or ``w<N>r<i>``.

Per-rank markers: ``{namespace}/{model}/_per_rank/lg{group}/{fingerprint}``, one per page
kind whose ranks were found holding different bytes where they should hold the same
(:mod:`kvconn.replicas`); five segments, ``_per_rank`` in the shard position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

from kvconn.errors import ConfigError

REPLICATED = "replicated"
#: The segment, in the shard position, that marks a layout manifest key.
LAYOUT = "_layout"
#: The segment, in the shard position, that marks a per-rank marker (kvconn.replicas).
PER_RANK = "_per_rank"


def shard_component(num_shards: int | None, shard_index: int = 0) -> str:
    """``replicated`` for bytes identical on every rank, else ``w<num_shards>r<index>``.

    ``num_shards`` is the width the page is cut at; it may later be a granularity G
    shared by several TP sizes (prefill TP=4, decode TP=8), which is why it is a
    parameter rather than read off the rank's own TP size.
    """
    if num_shards is None:
        return REPLICATED
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"invalid shard: width {num_shards}, index {shard_index}")
    return f"w{num_shards}r{shard_index}"


#: Characters of a name that stay as they are in a key; every other one is %-escaped.
_NAME_SAFE = "-_.~:@+="


def unprintable(text: str) -> str | None:
    """The first control or invisible character of ``text`` (NUL, newline, U+00A0 …), or None.

    Such a character in a name is a mistake (a C string's terminator, a pasted line
    break) that would otherwise become a key nobody else computes, or a label that
    breaks the line of a log or a report.
    """
    return next((c for c in text if not c.isprintable()), None)


def key_part(text: str, what: str) -> str:
    """Escape a user-supplied name so it stays one path segment of ASCII.

    Model names such as ``Org/Model-FP8`` contain ``/``; quoting keeps keys parseable
    (``kvconn inspect`` splits on ``/``) and within every backend's key alphabet.
    """
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{what} must be a non-empty string, got {text!r}")
    bad = unprintable(text)
    if bad is not None:
        raise ConfigError(
            f"{what} {text!r:.80} contains the control or invisible character "
            f"{bad!r} (U+{ord(bad):04X}); names must be printable text"
        )
    return quote(text, safe=_NAME_SAFE)


def spell_prefix(text: str) -> str:
    """A key prefix typed by a person, spelt the way keys spell names.

    ``--prefix kvconn/modèle`` must find the keys of model ``modèle``, which are
    ``kvconn/mod%C3%A8le/…``: every character :func:`key_part` escapes is escaped the
    same way here, except ``/`` (it separates the parts) and ``%`` (a prefix copied
    from a key, escapes included, stays as it is).
    """
    return quote(text, safe=_NAME_SAFE + "/%")


def key_prefix(namespace: str, model: str) -> str:
    return f"{key_part(namespace, 'namespace')}/{key_part(model, 'model')}/"


def page_key(prefix: str, component: str, group: int, fingerprint: str, block_hash: bytes) -> str:
    return page_key_stem(prefix, component, group, fingerprint) + block_hash.hex()


def page_key_stem(prefix: str, component: str, group: int, fingerprint: str) -> str:
    """A page kind's keys up to the block hash: a lookup of many blocks builds each of
    its keys as the stem and the hash in hex (:func:`page_key` is exactly that)."""
    return f"{prefix}{component}/lg{group}/{fingerprint}/"


def manifest_prefix(prefix: str) -> str:
    """Where a model's layout manifests live: ``{namespace}/{model}/_layout/``."""
    return f"{prefix}{LAYOUT}/"


def manifest_key(prefix: str, group: int, fingerprint: str) -> str:
    """The key of the manifest of the page kind ``fingerprint`` in layer group ``group``."""
    return f"{manifest_prefix(prefix)}lg{group}/{fingerprint}"


def per_rank_key(prefix: str, group: int, fingerprint: str) -> str:
    """The marker of a page kind whose ranks were found holding different bytes.

    ``fingerprint`` is the kind's own (shared) fingerprint. While the marker exists, every
    process that honours it keys that kind per rank (:mod:`kvconn.replicas`). Five
    segments with ``_per_rank`` in the shard position: never a page nor a manifest key.
    """
    return f"{prefix}{PER_RANK}/lg{group}/{fingerprint}"


# ---------------------------------------------------------------- parsing
_SHARD = re.compile(r"^(?:replicated|w([1-9][0-9]*)r(0|[1-9][0-9]*))$")
_GROUP = re.compile(r"^lg(0|[1-9][0-9]*)$")
_FINGERPRINT = re.compile(r"^t([1-9][0-9]*)b([1-9][0-9]*)-([0-9a-f]+)$")
_HASH = re.compile(r"^[0-9a-f]+$")


def fingerprint_geometry(fingerprint: str) -> tuple[int, int] | None:
    """``(tokens_per_block, page bytes)`` a fingerprint ``t{tokens}b{bytes}-{hex}`` names."""
    match = _FINGERPRINT.match(fingerprint)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class PageKey:
    """The parts of a page key (see :mod:`kvconn.keys`)."""

    namespace: str
    model: str
    shard: str
    num_shards: int | None  # None: replicated
    shard_index: int
    group: int
    tokens_per_block: int
    page_bytes: int
    fingerprint: str
    block_hash: str

    @property
    def shard_class(self) -> str:
        return "replicated" if self.num_shards is None else f"w{self.num_shards}"


def kvconn_alphabet(key: str) -> bool:
    """Whether ``key`` could be a kvconn key at all: printable ASCII without spaces.

    Other programs' keys sharing the store may be anything (non-ASCII, undecodable
    bytes listed as surrogate escapes); those are "other keys", never pages to read.
    """
    return key.isascii() and key.isprintable() and " " not in key


def parse_key(key: str) -> PageKey | None:
    """The parts of a kvconn page key, or ``None`` for any other key (manifests included)."""
    if not kvconn_alphabet(key):
        return None
    parts = key.split("/")
    if len(parts) != 6:
        return None
    namespace, model, shard, group, fingerprint, block_hash = parts
    m_shard = _SHARD.match(shard)
    m_group = _GROUP.match(group)
    m_fp = _FINGERPRINT.match(fingerprint)
    if not (namespace and model and m_shard and m_group and m_fp and _HASH.match(block_hash)):
        return None
    num_shards = int(m_shard.group(1)) if m_shard.group(1) else None
    shard_index = int(m_shard.group(2)) if m_shard.group(2) else 0
    if num_shards is not None and shard_index >= num_shards:
        return None
    return PageKey(
        namespace=unquote(namespace),
        model=unquote(model),
        shard=shard,
        num_shards=num_shards,
        shard_index=shard_index,
        group=int(m_group.group(1)),
        tokens_per_block=int(m_fp.group(1)),
        page_bytes=int(m_fp.group(2)),
        fingerprint=fingerprint,
        block_hash=block_hash,
    )


@dataclass(frozen=True)
class ManifestKey:
    """The parts of a layout manifest key (see :func:`kvconn.keys.manifest_key`)."""

    namespace: str
    model: str
    group: int
    fingerprint: str
    prefix: str  # ``{namespace}/{model}/`` as stored (quoted)


def parse_manifest_key(key: str) -> ManifestKey | None:
    """The parts of a layout manifest key, or ``None`` for any other key (pages included)."""
    if not kvconn_alphabet(key):
        return None
    parts = key.split("/")
    if len(parts) != 5:
        return None
    namespace, model, marker, group, fingerprint = parts
    m_group = _GROUP.match(group)
    if not (namespace and model and marker == LAYOUT and m_group):
        return None
    if not _FINGERPRINT.match(fingerprint):
        return None
    return ManifestKey(
        namespace=unquote(namespace),
        model=unquote(model),
        group=int(m_group.group(1)),
        fingerprint=fingerprint,
        prefix=f"{namespace}/{model}/",
    )
