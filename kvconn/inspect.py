"""Report a store's footprint by model, shard class and layer group, from its keys alone.

Keys are ``{namespace}/{model}/{shard}/lg{group}/t{tokens}b{bytes}-{fp}/{hash}`` with
the model URL-quoted, so a listing is enough to tell how many bytes each model keeps,
how much of it is replicated (stored once for the whole TP group) and how much is
sharded (``w<N>``: one page per shard). Works with backends that can list keys
(``capabilities.listing``); the others fail with a message naming those that can.

    kvconn inspect                      # the default LMDB store
    kvconn inspect --path /tmp/store --json
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from kvconn.errors import ConfigError
from kvconn.registry import backend_class, installed_backends, load_backend

_SHARD = re.compile(r"^(?:replicated|w([1-9][0-9]*)r(0|[1-9][0-9]*))$")
_GROUP = re.compile(r"^lg(0|[1-9][0-9]*)$")
_FINGERPRINT = re.compile(r"^t([1-9][0-9]*)b([1-9][0-9]*)-([0-9a-f]+)$")
_HASH = re.compile(r"^[0-9a-f]+$")


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


def parse_key(key: str) -> PageKey | None:
    """The parts of a kvconn page key, or ``None`` for any other key."""
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


@dataclass
class Row:
    """Pages of one (namespace, model, shard class, layer group, page geometry)."""

    pages: int = 0
    bytes: int = 0
    shards: set[int] = field(default_factory=set)
    blocks: set[str] = field(default_factory=set)
    size_mismatches: int = 0  # stored value size differs from the key's b<bytes>


@dataclass
class Footprint:
    rows: dict[tuple[str, str, str, int, str], Row] = field(default_factory=dict)
    other_keys: int = 0
    other_bytes: int = 0

    def add(self, key: str, size: int) -> None:
        page = parse_key(key)
        if page is None:
            self.other_keys += 1
            self.other_bytes += size
            return
        ident = (page.namespace, page.model, page.shard_class, page.group, page.fingerprint)
        row = self.rows.setdefault(ident, Row())
        row.pages += 1
        row.bytes += size
        row.shards.add(page.shard_index)
        row.blocks.add(page.block_hash)
        if size != page.page_bytes:
            row.size_mismatches += 1

    def as_dict(self) -> dict[str, Any]:
        models: dict[tuple[str, str], dict[str, Any]] = {}
        for (namespace, model, cls, group, fingerprint), row in sorted(self.rows.items()):
            entry = models.setdefault(
                (namespace, model),
                {
                    "namespace": namespace,
                    "model": model,
                    "pages": 0,
                    "bytes": 0,
                    "replicated_bytes": 0,
                    "sharded_bytes": 0,
                    "classes": [],
                },
            )
            entry["pages"] += row.pages
            entry["bytes"] += row.bytes
            entry["replicated_bytes" if cls == "replicated" else "sharded_bytes"] += row.bytes
            m = _FINGERPRINT.match(fingerprint)
            assert m is not None
            entry["classes"].append(
                {
                    "shard_class": cls,
                    "layer_group": group,
                    "fingerprint": fingerprint,
                    "tokens_per_block": int(m.group(1)),
                    "page_bytes": int(m.group(2)),
                    "pages": row.pages,
                    "bytes": row.bytes,
                    "blocks": len(row.blocks),
                    "shards_present": len(row.shards),
                    "size_mismatches": row.size_mismatches,
                }
            )
        return {
            "keys": sum(r.pages for r in self.rows.values()) + self.other_keys,
            "bytes": sum(r.bytes for r in self.rows.values()) + self.other_bytes,
            "models": list(models.values()),
            "other_keys": self.other_keys,
            "other_bytes": self.other_bytes,
        }


def footprint(entries: Iterable[tuple[str, int]]) -> Footprint:
    fp = Footprint()
    for key, size in entries:
        fp.add(key, size)
    return fp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvconn.simulate.store import add_store_arguments

    parser.add_argument(
        "--prefix",
        default="",
        help="only keys starting with this (e.g. 'kvconn/minimax-m3/'); default all keys",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_store_arguments(parser)


def _listing_backends() -> list[str]:
    names = []
    for name in installed_backends():
        try:
            if backend_class(name).capabilities.listing:
                names.append(name)
        except Exception:  # a backend whose client is missing cannot be asked
            continue
    return names


def run(args: argparse.Namespace) -> int:
    from kvconn.simulate.store import store_settings

    settings = store_settings(args)
    name = settings["backend"]
    cls = backend_class(name)
    if not cls.capabilities.listing:
        can = ", ".join(_listing_backends()) or "none installed"
        raise ConfigError(
            f"the {name!r} backend cannot list its keys (capabilities.listing is False), so "
            f"kvconn inspect cannot read its footprint; backends that can: {can}"
        )
    prefix = args.prefix
    if not prefix and args.namespace:
        prefix = f"{args.namespace}/"
    with load_backend(name, settings["options"]) as backend:
        result = footprint(backend.list_keys(prefix)).as_dict()
        result["backend"] = name
        path = getattr(backend, "path", None)
        result["store"] = f"{name} at {path}" if path is not None else name
        result["prefix"] = prefix
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_footprint(result))
    return 0


def _human(n: float) -> str:
    from kvconn.simulate.report import human_bytes

    return human_bytes(n)


def format_footprint(result: Mapping[str, Any]) -> str:
    lines = [
        f"kvconn inspect: {result['store']}"
        + (f", keys starting with {result['prefix']!r}" if result["prefix"] else ""),
        f"  {result['keys']:,} keys, {_human(result['bytes'])}",
    ]
    if not result["models"] and not result["other_keys"]:
        lines.append("  (empty)")
    for model in result["models"]:
        total = model["bytes"] or 1
        lines.append("")
        lines.append(
            f"  {model['namespace']}/{model['model']}: {model['pages']:,} pages, "
            f"{_human(model['bytes'])} (replicated {model['replicated_bytes'] / total:.1%}, "
            f"sharded {model['sharded_bytes'] / total:.1%})"
        )
        lines.append(
            f"    {'class':<11} {'group':>5} {'tokens':>6} {'page':>11} {'blocks':>8} "
            f"{'shards':>6} {'pages':>9} {'bytes':>12}"
        )
        for c in model["classes"]:
            lines.append(
                f"    {c['shard_class']:<11} {'lg' + str(c['layer_group']):>5} "
                f"{c['tokens_per_block']:>6} {_human(c['page_bytes']):>11} {c['blocks']:>8,} "
                f"{c['shards_present']:>6} {c['pages']:>9,} {_human(c['bytes']):>12}"
            )
            if c["size_mismatches"]:
                lines.append(
                    f"      {c['size_mismatches']} value(s) whose size differs from the key's "
                    f"{c['page_bytes']} bytes: they will fail to load"
                )
    if result["other_keys"]:
        lines.append("")
        lines.append(
            f"  {result['other_keys']:,} other key(s), {_human(result['other_bytes'])}: "
            "not kvconn page keys"
        )
    return "\n".join(lines)
