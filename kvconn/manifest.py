"""Page manifests: what the bytes of one page kind mean, as hashed and as stored.

The fingerprint in every page key hashes :meth:`PageManifest.meaning`; the manifest
stored once per page kind (``kvconn.keys.manifest_key``) is :meth:`PageManifest.document`.
Both come from one object so they cannot disagree, and a manifest read back from a
store is checked by recomputing its fingerprint (``kvconn inspect``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kvconn.errors import KvconnError, LayoutError
from kvconn.integrity import DEFAULT as DEFAULT_CHECKSUM
from kvconn.integrity import SCHEMES as CHECKSUM_SCHEMES
from kvconn.layout import Role


class ManifestError(KvconnError, ValueError):
    """A layout manifest that cannot be read back into a :class:`PageManifest`."""


#: Version of the page description: hashed into every fingerprint as ``"v"`` and written
#: as ``"version"`` in every manifest. A new version changes every key. Version 2 added
#: the checksum trailer (``checksum``): stores of version 1 read as misses.
LAYOUT_VERSION = 2

_CLASS_LABEL = re.compile(r"^(?:replicated|w([1-9][0-9]*))$")
_MANIFEST_FIELDS = {
    "version",
    "tokens_per_block",
    "shard_class",
    "num_shards",
    "page_size",
    "checksum",
    "value_size",
    "roles",
    "regions",
}
_ROLE_FIELDS = {"units", "dtype", "bytes_per_page"}


@dataclass(frozen=True)
class PageManifest:
    """What the bytes of one page kind mean: the single source of fingerprint and manifest.

    The fingerprint hashes :meth:`meaning`; the manifest stored under
    :func:`kvconn.keys.manifest_key` is :meth:`document`, which is the same facts plus
    sizes derived from them (``num_shards``, ``page_size``, ``value_size``, each role's
    ``bytes_per_page``). Both come from this one object, so they cannot disagree, and a
    manifest read back from a store is checked by recomputing its fingerprint.
    """

    tokens_per_block: int
    shard_class: str  # ``replicated`` or ``w<num_shards>``
    roles: tuple[tuple[str, int, str], ...]  # (name, units, dtype), sorted by name
    regions: tuple[tuple[int, str, int], ...]  # (layer, role, size), in page order
    #: The trailer after each page (:mod:`kvconn.integrity`): what a stored value holds
    #: besides the page, so it changes the key like any other change of the bytes.
    checksum: str = DEFAULT_CHECKSUM
    version: int = LAYOUT_VERSION

    @property
    def num_shards(self) -> int:
        """Pages per block of this kind: 1 for the replicated class, else N of ``wN``."""
        return 1 if self.shard_class == "replicated" else int(self.shard_class[1:])

    @property
    def page_size(self) -> int:
        """Payload bytes of a page: what it holds of the pool (``b<bytes>`` in its key)."""
        return sum(size for _, _, size in self.regions)

    @property
    def value_size(self) -> int:
        """Bytes of a stored value: the page and its checksum trailer."""
        return self.page_size + CHECKSUM_SCHEMES[self.checksum]

    @property
    def role_bytes(self) -> dict[str, int]:
        """Bytes of each role in one page, roles by name."""
        out = {name: 0 for name, _, _ in self.roles}
        for _, role, size in self.regions:
            out[role] += size
        return out

    def meaning(self) -> dict[str, Any]:
        """Exactly what the fingerprint hashes (its form is pinned: keys depend on it)."""
        return {
            "v": self.version,
            "tokens_per_block": self.tokens_per_block,
            "class": self.shard_class,
            "roles": {name: [units, dtype] for name, units, dtype in self.roles},
            "regions": [[layer, role, size] for layer, role, size in self.regions],
            "checksum": self.checksum,
        }

    @property
    def fingerprint(self) -> str:
        """``t{tokens_per_block}b{page_size}-{12 hex digits}``: the key segment."""
        digest = hashlib.blake2b(
            json.dumps(self.meaning(), sort_keys=True).encode(),
            digest_size=6,
            person=b"kvconn-layout",
        ).hexdigest()
        return f"t{self.tokens_per_block}b{self.page_size}-{digest}"

    def document(self) -> dict[str, Any]:
        """The manifest: the meaning in readable form, with the sizes derived from it."""
        role_bytes = self.role_bytes
        return {
            "version": self.version,
            "tokens_per_block": self.tokens_per_block,
            "shard_class": self.shard_class,
            "num_shards": self.num_shards,
            "page_size": self.page_size,
            "checksum": self.checksum,
            "value_size": self.value_size,
            "roles": {
                name: {"units": units, "dtype": dtype, "bytes_per_page": role_bytes[name]}
                for name, units, dtype in self.roles
            },
            "regions": [[layer, role, size] for layer, role, size in self.regions],
        }

    def to_json(self) -> bytes:
        """The canonical manifest value: sorted keys, no spaces, ASCII."""
        return json.dumps(self.document(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | str) -> PageManifest:
        """Read a manifest back; :class:`ManifestError` says what is wrong with it.

        Every derived size must agree with the regions, so a manifest that parses is
        self-consistent; whether it belongs to a key is the caller's check
        (``manifest.fingerprint == fingerprint in the key``).
        """
        try:
            raw = data if isinstance(data, str) else bytes(data).decode("utf-8")
            doc = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"not a JSON object: {type(doc).__name__}")
        if doc.get("version") == 1:
            raise ManifestError(
                "layout version 1, written by a kvconn without page checksums: "
                "its pages are no longer read (they read as misses)"
            )
        if set(doc) != _MANIFEST_FIELDS:
            missing = sorted(_MANIFEST_FIELDS - set(doc))
            extra = sorted(set(doc) - _MANIFEST_FIELDS)
            raise ManifestError(f"fields missing {missing}, unknown {extra}")
        version = _json_int(doc["version"], "version", minimum=1)
        if version != LAYOUT_VERSION:
            raise ManifestError(f"version {version} is not {LAYOUT_VERSION}")
        label = doc["shard_class"]
        m_label = _CLASS_LABEL.match(label) if isinstance(label, str) else None
        if m_label is None:
            raise ManifestError(f"shard_class {label!r} is not 'replicated' or 'w<N>'")
        roles_doc = doc["roles"]
        if not isinstance(roles_doc, dict) or not roles_doc:
            raise ManifestError("roles must be a non-empty object")
        roles: list[tuple[str, int, str]] = []
        for name in sorted(roles_doc):
            spec = roles_doc[name]
            if not isinstance(spec, dict) or set(spec) != _ROLE_FIELDS:
                raise ManifestError(f"role {name!r} must have exactly {sorted(_ROLE_FIELDS)}")
            units = _json_int(spec["units"], f"{name}.units", minimum=1)
            try:  # what a layout could not declare, no manifest may claim (tools print it)
                role = Role(name, units, spec["dtype"])
            except LayoutError as exc:
                raise ManifestError(str(exc)) from None
            roles.append((role.name, role.units, role.dtype))
        checksum = doc["checksum"]
        if not isinstance(checksum, str) or checksum not in CHECKSUM_SCHEMES:
            raise ManifestError(
                f"checksum {checksum!r} is not one of {', '.join(map(repr, CHECKSUM_SCHEMES))}"
            )
        regions_doc = doc["regions"]
        if not isinstance(regions_doc, list) or not regions_doc:
            raise ManifestError("regions must be a non-empty list")
        regions: list[tuple[int, str, int]] = []
        for item in regions_doc:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[1], str)
                and item[1] in roles_doc
            ):
                raise ManifestError(f"region {item!r} is not [layer, declared role, size]")
            layer = _json_int(item[0], "region layer", minimum=0)
            regions.append((layer, item[1], _json_int(item[2], "region size", minimum=1)))
        manifest = cls(
            tokens_per_block=_json_int(doc["tokens_per_block"], "tokens_per_block", minimum=1),
            shard_class=label,
            roles=tuple(roles),
            regions=tuple(regions),
            checksum=checksum,
            version=version,
        )
        unused = sorted(set(roles_doc) - {role for _, role, _ in regions})
        if unused:
            raise ManifestError(f"roles {unused} have no region")
        replicated = label == "replicated"
        if any((units == 1) != replicated for _, units, _ in manifest.roles):
            raise ManifestError(
                f"shard_class {label!r} but role units {[u for _, u, _ in manifest.roles]}: "
                "the replicated class holds exactly the roles with units 1"
            )
        derived = manifest.document()
        for name in ("num_shards", "page_size", "value_size"):
            if _json_int(doc[name], name, minimum=1) != derived[name]:
                raise ManifestError(
                    f"{name} {doc[name]!r}, the page description gives {derived[name]}"
                )
        for name, spec in roles_doc.items():
            want = derived["roles"][name]["bytes_per_page"]
            if _json_int(spec["bytes_per_page"], f"{name}.bytes_per_page", minimum=1) != want:
                raise ManifestError(
                    f"role {name!r}: bytes_per_page {spec['bytes_per_page']!r}, "
                    f"its regions give {want}"
                )
        return manifest


def _json_int(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value
