"""Report a store's footprint by model, role, shard class and layer group.

Page keys are ``{namespace}/{model}/{shard}/lg{group}/t{tokens}b{bytes}-{fp}/{hash}``
with the model URL-quoted, so a listing is enough to tell how many bytes each model
keeps, how much of it is replicated (stored once for the whole TP group) and how much is
sharded (``w<N>``: one page per shard). Which roles (``k``, ``v``, ``index_k``,
``latent``…) a page holds is hashed inside the fingerprint; the connector therefore
also stores one *layout manifest* per page kind, ``{namespace}/{model}/_layout/lg{group}/
{fingerprint}``, whose JSON value lists the roles and their bytes per page. Inspect
reads those manifests, checks that each one hashes to its key's fingerprint, and splits
every page kind's bytes by role (``pages x bytes_per_page``). Pages without a manifest
(stores written before manifests existed, or a manifest evicted) are reported as
unknown roles; an invalid manifest is flagged. Manifests are metadata, reported apart
from page bytes.

A stored value is the page (``b<bytes>`` in its key: the payload) and the trailer of
the checksum scheme the manifest names (8 bytes for ``xxh3-64``), so a value whose size
is not ``value_size`` will fail to load. Without a manifest the scheme is unknown: a
size that no scheme gives for ``b<bytes>`` is reported all the same.

Works with backends that can list keys (``capabilities.listing``); the others fail with
a message naming those that can. The store is opened read-only where the backend can
(LMDB): a mistyped ``--path`` is an error, never a new empty store.

    kvconn inspect                      # the default LMDB store
    kvconn inspect --path /tmp/store --json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig, typed_text
from kvconn.errors import ConfigError
from kvconn.integrity import SCHEMES as CHECKSUM_SCHEMES
from kvconn.keys import (
    fingerprint_geometry,
    key_part,
    manifest_prefix,
    parse_key,
    parse_manifest_key,
    spell_prefix,
)
from kvconn.manifest import ManifestError, PageManifest
from kvconn.registry import accepted_options, backend_class, installed_backends, load_backend
from kvconn.tools.store_options import add_store_arguments, human_bytes, store_settings

#: A manifest lists a few dozen bytes per (layer, role); a value this large is not one.
MAX_MANIFEST_BYTES = 1 << 20


@dataclass
class Manifest:
    """A layout manifest found in the store, and what reading it gave."""

    key: str
    size: int
    listed: bool  # under the inspected prefix: counted in the store's keys and bytes
    manifest: PageManifest | None = None  # set when read and valid for its key
    problem: str | None = None  # why it cannot be used (set when read and invalid)

    @property
    def read(self) -> bool:
        return self.manifest is not None or self.problem is not None


@dataclass
class Row:
    """Pages of one (namespace, model, shard class, layer group, page geometry)."""

    pages: int = 0
    bytes: int = 0
    shards: set[int] = field(default_factory=set)
    blocks: set[str] = field(default_factory=set)
    #: how many values of each size: judged once the manifest (the checksum scheme,
    #: hence the value size) is known, after the listing
    value_sizes: Counter[int] = field(default_factory=Counter)


ManifestIdent = tuple[str, str, int, str]  # namespace, model, layer group, fingerprint


@dataclass
class Footprint:
    rows: dict[tuple[str, str, str, int, str], Row] = field(default_factory=dict)
    manifests: dict[ManifestIdent, Manifest] = field(default_factory=dict)
    prefixes: dict[tuple[str, str], str] = field(default_factory=dict)  # stored key prefix
    other_keys: int = 0
    other_bytes: int = 0

    def add(self, key: str, size: int, *, listed: bool = True) -> None:
        """Count one listed key; ``listed=False`` records a manifest found outside the prefix."""
        page = parse_key(key)
        if page is None:
            mkey = parse_manifest_key(key)
            if mkey is not None:
                mident = (mkey.namespace, mkey.model, mkey.group, mkey.fingerprint)
                self.manifests.setdefault(mident, Manifest(key, size, listed))
                self.prefixes.setdefault((mkey.namespace, mkey.model), mkey.prefix)
            elif listed:
                self.other_keys += 1
                self.other_bytes += size
            return
        ident = (page.namespace, page.model, page.shard_class, page.group, page.fingerprint)
        row = self.rows.setdefault(ident, Row())
        row.pages += 1
        row.bytes += size
        row.shards.add(page.shard_index)
        row.blocks.add(page.block_hash)
        row.value_sizes[size] += 1
        if (page.namespace, page.model) not in self.prefixes:
            self.prefixes[(page.namespace, page.model)] = key[: _nth_slash(key, 2) + 1]

    def set_manifest_value(self, key: str, value: bytes | None) -> None:
        """Record what reading a manifest gave; ``None``: it could not be read."""
        mkey = parse_manifest_key(key)
        if mkey is None:
            raise ValueError(f"{key!r} is not a layout manifest key")
        entry = self.manifests.get((mkey.namespace, mkey.model, mkey.group, mkey.fingerprint))
        if entry is None:
            raise ValueError(f"{key!r} was not listed")
        entry.manifest, entry.problem = None, None
        if value is None:
            entry.problem = "could not be read (evicted or failed since it was listed)"
            return
        try:
            manifest = PageManifest.from_json(value)
        except ManifestError as exc:
            entry.problem = f"unreadable: {exc}"
            return
        if manifest.fingerprint != mkey.fingerprint:
            entry.problem = (
                f"its JSON hashes to {manifest.fingerprint}, not to the key's fingerprint "
                f"{mkey.fingerprint}: it does not describe these pages"
            )
            return
        entry.manifest = manifest

    def model_prefixes(self) -> list[str]:
        """The stored ``{namespace}/{model}/`` prefix of every model with pages or manifests."""
        return sorted(set(self.prefixes.values()))

    def _row_roles(
        self, namespace: str, model: str, cls: str, group: int, fingerprint: str
    ) -> tuple[str, PageManifest | None, str | None]:
        """(status, manifest, problem) for one row: ``ok``, ``missing`` or ``invalid``."""
        entry = self.manifests.get((namespace, model, group, fingerprint))
        if entry is None or not entry.read:
            return "missing", None, None
        if entry.manifest is None:
            return "invalid", None, entry.problem
        if entry.manifest.shard_class != cls:
            return (
                "invalid",
                None,
                f"the manifest describes a {entry.manifest.shard_class} page, "
                f"these page keys are {cls}",
            )
        return "ok", entry.manifest, None

    def as_dict(self) -> dict[str, Any]:
        models: dict[tuple[str, str], dict[str, Any]] = {}

        def model_entry(namespace: str, model: str) -> dict[str, Any]:
            return models.setdefault(
                (namespace, model),
                {
                    "namespace": namespace,
                    "model": model,
                    "pages": 0,
                    "bytes": 0,
                    "payload_bytes": 0,
                    "checksum_bytes": 0,
                    "replicated_bytes": 0,
                    "sharded_bytes": 0,
                    "role_bytes": {},
                    "unknown_role_bytes": 0,
                    "manifest_keys": 0,
                    "manifest_bytes": 0,
                    "invalid_manifests": [],
                    "classes": [],
                },
            )

        for (namespace, model, cls, group, fingerprint), row in sorted(self.rows.items()):
            entry = model_entry(namespace, model)
            entry["pages"] += row.pages
            entry["bytes"] += row.bytes
            entry["replicated_bytes" if cls == "replicated" else "sharded_bytes"] += row.bytes
            geometry = fingerprint_geometry(fingerprint)
            assert geometry is not None  # only parsed keys make rows
            tokens_per_block, page_bytes = geometry
            entry["payload_bytes"] += row.pages * page_bytes
            status, manifest, problem = self._row_roles(namespace, model, cls, group, fingerprint)
            if manifest is not None:
                sizes = {manifest.value_size}
                entry["checksum_bytes"] += row.pages * (manifest.value_size - page_bytes)
            else:  # the scheme is unknown: any size some scheme gives is plausible
                sizes = {page_bytes + trailer for trailer in CHECKSUM_SCHEMES.values()}
            roles: dict[str, dict[str, int]] | None = None
            if manifest is not None:
                roles = {
                    name: {"bytes_per_page": per_page, "bytes": row.pages * per_page}
                    for name, per_page in sorted(manifest.role_bytes.items())
                }
                for name, r in roles.items():
                    entry["role_bytes"][name] = entry["role_bytes"].get(name, 0) + r["bytes"]
            else:
                entry["unknown_role_bytes"] += row.pages * page_bytes
            entry["classes"].append(
                {
                    "shard_class": cls,
                    "layer_group": group,
                    "fingerprint": fingerprint,
                    "tokens_per_block": tokens_per_block,
                    "page_bytes": page_bytes,
                    "checksum": manifest.checksum if manifest is not None else None,
                    "value_bytes": manifest.value_size if manifest is not None else None,
                    "pages": row.pages,
                    "bytes": row.bytes,
                    "payload_bytes": row.pages * page_bytes,
                    "blocks": len(row.blocks),
                    "shards_present": len(row.shards),
                    "size_mismatches": sum(
                        n for size, n in row.value_sizes.items() if size not in sizes
                    ),
                    "manifest": status,
                    "manifest_problem": problem,
                    "roles": roles,
                }
            )
        for (namespace, model, group, fingerprint), man in sorted(self.manifests.items()):
            if not man.listed and (namespace, model) not in models:
                continue
            entry = model_entry(namespace, model)
            if man.listed:
                entry["manifest_keys"] += 1
                entry["manifest_bytes"] += man.size
            if man.problem is not None:
                entry["invalid_manifests"].append(
                    {
                        "key": man.key,
                        "layer_group": group,
                        "fingerprint": fingerprint,
                        "problem": man.problem,
                    }
                )
        for entry in models.values():
            entry["role_bytes"] = dict(sorted(entry["role_bytes"].items()))
        listed = [m for m in self.manifests.values() if m.listed]
        page_keys = sum(r.pages for r in self.rows.values())
        page_bytes = sum(r.bytes for r in self.rows.values())
        return {
            "keys": page_keys + len(listed) + self.other_keys,
            "bytes": page_bytes + sum(m.size for m in listed) + self.other_bytes,
            "models": [models[k] for k in sorted(models)],
            "manifest_keys": len(listed),
            "manifest_bytes": sum(m.size for m in listed),
            "other_keys": self.other_keys,
            "other_bytes": self.other_bytes,
        }


def _nth_slash(key: str, n: int) -> int:
    at = -1
    for _ in range(n):
        at = key.index("/", at + 1)
    return at


def footprint(
    entries: Iterable[tuple[str, int]], manifests: Mapping[str, bytes | None] | None = None
) -> Footprint:
    """The footprint of listed ``(key, size)`` entries; ``manifests`` maps manifest keys
    (listed or not) to their values, as :func:`read_manifests` would fetch them."""
    fp = Footprint()
    for key, size in entries:
        fp.add(key, size)
    for key, value in (manifests or {}).items():
        fp.add(key, len(value) if value is not None else 0, listed=False)
        fp.set_manifest_value(key, value)
    return fp


def read_manifests(fp: Footprint, backend: Backend, prefix: str = "") -> None:
    """Fetch the layout manifests of every model in ``fp`` with one batched ``get``.

    Manifests under ``prefix`` came with the listing; for a model whose ``_layout/``
    keys lie outside it (``--prefix kvconn/m/w8r0/``) they are listed here, for the role
    breakdown only: they are not counted among the inspected keys.
    """
    for model_prefix in fp.model_prefixes():
        where = manifest_prefix(model_prefix)
        if not where.startswith(prefix):
            for key, size in backend.list_keys(where):
                fp.add(key, size, listed=False)
    todo = [m for m in fp.manifests.values() if not m.read]
    for m in todo:
        if m.size > MAX_MANIFEST_BYTES:
            m.problem = f"{m.size} bytes: too large to be a layout manifest"
        elif m.size == 0:
            m.problem = "empty value"
    todo = [m for m in todo if not m.read]
    if not todo:
        return
    buffers = [bytearray(m.size) for m in todo]
    ok = backend.get([m.key for m in todo], buffers, scratch=True)  # used only where good
    for m, buf, good in zip(todo, buffers, ok):
        fp.set_manifest_value(m.key, bytes(buf) if good else None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix",
        default="",
        help="only keys starting with this (e.g. 'kvconn/minimax-m3/'); default all keys. "
        "Characters that keys escape in names are escaped the same way ('modèle' finds "
        "'mod%%C3%%A8le'); '/' and '%%' are taken as written",
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
    settings = store_settings(args)
    name = settings["backend"]
    cls = backend_class(name)
    if not cls.capabilities.listing:
        can = ", ".join(_listing_backends()) or "none installed"
        raise ConfigError(
            f"the {name!r} backend cannot list its keys (capabilities.listing is False), so "
            f"kvconn inspect cannot read its footprint; backends that can: {can}"
        )
    # Every field of a --config file is checked as a connector would check it, though
    # inspect needs only the store and the namespace from it.
    config = ConnectorConfig.from_dict({"model": "inspect", **settings})
    # Typed text, spelt as keys spell names: `--prefix kvconn/modèle` finds model modèle.
    prefix = spell_prefix(str(typed_text(args.prefix, "--prefix")))
    if not prefix and settings.get("namespace") is not None:
        prefix = f"{key_part(config.namespace, 'namespace')}/"  # as keys spell it
    options = dict(settings["options"])
    if "readonly" in accepted_options(cls)[0]:
        # Look, never touch: a mistyped --path must not leave an empty store behind.
        options.setdefault("readonly", True)
    with load_backend(name, options) as backend:
        fp = footprint(backend.list_keys(prefix))
        read_manifests(fp, backend, prefix)
        result = fp.as_dict()
        result["backend"] = name
        path = getattr(backend, "path", None)
        result["store"] = f"{name} at {path}" if path is not None else name
        result["prefix"] = prefix
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_footprint(result))
    return 0


def _roles_text(c: Mapping[str, Any]) -> str:
    if c["roles"] is not None:
        return ", ".join(f"{name} {human_bytes(r['bytes'])}" for name, r in c["roles"].items())
    if c["manifest"] == "invalid":
        return "unknown (invalid manifest)"
    return "unknown (no manifest)"


def format_footprint(result: Mapping[str, Any]) -> str:
    lines = [
        f"kvconn inspect: {result['store']}"
        + (f", keys starting with {result['prefix']!r}" if result["prefix"] else ""),
        f"  {result['keys']:,} keys, {human_bytes(result['bytes'])}",
    ]
    if not result["models"] and not result["other_keys"]:
        lines.append("  (empty)")
    for model in result["models"]:
        total = model["bytes"] or 1
        lines.append("")
        lines.append(
            f"  {model['namespace']}/{model['model']}: {model['pages']:,} pages, "
            f"{human_bytes(model['bytes'])} (replicated {model['replicated_bytes'] / total:.1%}, "
            f"sharded {model['sharded_bytes'] / total:.1%})"
        )
        # roles share the pages' payload: checksum trailers belong to no role
        payload = model["payload_bytes"] or 1
        by_role = [
            f"{name} {human_bytes(n)} ({n / payload:.1%})"
            for name, n in model["role_bytes"].items()
        ]
        if model["unknown_role_bytes"]:
            n = model["unknown_role_bytes"]
            by_role.append(f"unknown roles {human_bytes(n)} ({n / payload:.1%})")
        if by_role:
            lines.append(f"    by role: {', '.join(by_role)}")
        if model["classes"]:
            lines.append(
                f"    {'class':<11} {'group':>5} {'tokens':>6} {'page':>11} {'blocks':>8} "
                f"{'shards':>6} {'pages':>9} {'bytes':>12}  roles"
            )
        for c in model["classes"]:
            lines.append(
                f"    {c['shard_class']:<11} {'lg' + str(c['layer_group']):>5} "
                f"{c['tokens_per_block']:>6} {human_bytes(c['page_bytes']):>11} {c['blocks']:>8,} "
                f"{c['shards_present']:>6} {c['pages']:>9,} {human_bytes(c['bytes']):>12}  "
                f"{_roles_text(c)}"
            )
            if c["size_mismatches"]:
                expected = (
                    f"{c['value_bytes']} bytes ({c['page_bytes']} + {c['checksum']} checksum)"
                    if c["value_bytes"] is not None
                    else f"what the key's {c['page_bytes']} bytes and any checksum give"
                )
                lines.append(
                    f"      {c['size_mismatches']} value(s) whose size is not {expected}: "
                    "they will fail to load"
                )
            if c["manifest"] == "invalid" and c["manifest_problem"]:
                lines.append(f"      invalid layout manifest: {c['manifest_problem']}")
        if model["checksum_bytes"]:
            lines.append(
                f"    page payload {human_bytes(model['payload_bytes'])}, checksum trailers "
                f"{human_bytes(model['checksum_bytes'])} ({model['checksum_bytes'] / total:.2%})"
            )
        if model["manifest_keys"]:
            lines.append(
                f"    {model['manifest_keys']:,} layout manifest(s), "
                f"{human_bytes(model['manifest_bytes'])}: metadata, not counted as page bytes"
            )
        shown = {
            (c["layer_group"], c["fingerprint"]) for c in model["classes"] if c["manifest_problem"]
        }
        for bad in model["invalid_manifests"]:
            if (bad["layer_group"], bad["fingerprint"]) not in shown:
                lines.append(f"    invalid layout manifest {bad['key']}: {bad['problem']}")
    if result["other_keys"]:
        lines.append("")
        lines.append(
            f"  {result['other_keys']:,} other key(s), {human_bytes(result['other_bytes'])}: "
            "not kvconn page keys or layout manifests"
        )
    return "\n".join(lines)
