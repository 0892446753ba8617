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
"""

from __future__ import annotations

from urllib.parse import quote

from kvconn.errors import ConfigError

REPLICATED = "replicated"
#: The segment, in the shard position, that marks a layout manifest key.
LAYOUT = "_layout"


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


def key_part(text: str, what: str) -> str:
    """Escape a user-supplied name so it stays one path segment of ASCII.

    Model names such as ``Org/Model-FP8`` contain ``/``; quoting keeps keys parseable
    (``kvconn inspect`` splits on ``/``) and within every backend's key alphabet.
    """
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{what} must be a non-empty string, got {text!r}")
    return quote(text, safe="-_.~:@+=")


def key_prefix(namespace: str, model: str) -> str:
    return f"{key_part(namespace, 'namespace')}/{key_part(model, 'model')}/"


def page_key(prefix: str, component: str, group: int, fingerprint: str, block_hash: bytes) -> str:
    return f"{prefix}{component}/lg{group}/{fingerprint}/{block_hash.hex()}"


def manifest_prefix(prefix: str) -> str:
    """Where a model's layout manifests live: ``{namespace}/{model}/_layout/``."""
    return f"{prefix}{LAYOUT}/"


def manifest_key(prefix: str, group: int, fingerprint: str) -> str:
    """The key of the manifest of the page kind ``fingerprint`` in layer group ``group``."""
    return f"{manifest_prefix(prefix)}lg{group}/{fingerprint}"
