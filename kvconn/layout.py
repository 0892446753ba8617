"""Descriptions of a rank's KV-cache pool: roles, regions, layer groups.

Everything here is a frozen dataclass validated at construction, so a layout that
cannot be stored correctly is refused when the engine registers its caches, not
discovered later as silently wrong bytes in someone else's request.

The layout is *symmetric*: every rank of the TP group has the same regions (the same
geometry; its own bytes). That is what lets any single process plan the keys of every
rank's pages, which the group-wide hit rule needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeAlias

from kvconn.errors import LayoutError
from kvconn.keys import unprintable

if TYPE_CHECKING:  # layouts are plain data: only from_tensor reads tensors, by duck typing
    import torch

_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class ShardPosition:
    """Where one rank's slice of a role sits among the TP group's copies."""

    num_shards: int
    dup: int
    shard_index: int
    replica_index: int


def shard_position(rank: int, tp_size: int, units: int) -> ShardPosition:
    """Shard position per DESIGN.md: consecutive ranks hold the same shard.

    GQA engines duplicate a KV head on consecutive ranks (rank // dup), so the same rule
    keeps our shard numbering equal to the engine's head placement.
    """
    for name, value in (("rank", rank), ("tp_size", tp_size), ("units", units)):
        # rank=1.0 would pass the range check and key pages "r1.0" nobody asks for
        _int(value, name, "shard position")
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise LayoutError(f"rank {rank} is outside the TP group of size {tp_size}")
    if units < 1:
        raise LayoutError(f"units must be >= 1, got {units}")
    if units % tp_size != 0 and tp_size % units != 0:
        raise LayoutError(f"units={units} neither divides nor is divisible by tp_size={tp_size}")
    num_shards = min(tp_size, units)
    dup = tp_size // num_shards
    return ShardPosition(num_shards, dup, rank // dup, rank % dup)


@dataclass(frozen=True)
class Role:
    """A kind of per-token bytes in a layer (``k``, ``v``, ``index_k``, ``latent`` …).

    ``units`` is how many distinct slices of the role exist across the whole TP group:
    global KV heads for K/V, 1 for bytes every rank holds identically. ``dtype`` names
    the bytes' meaning (``bf16``, ``fp8_e4m3+scale``…); it goes into every key so that
    a reader that would interpret the bytes differently misses instead.
    """

    name: str
    units: int
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise LayoutError(f"role name {self.name!r} must be lower-case letters, digits and '_'")
        if isinstance(self.units, bool) or not isinstance(self.units, int) or self.units < 1:
            raise LayoutError(f"role {self.name!r}: units must be an int >= 1, got {self.units!r}")
        # The dtype is hashed into keys and written into layout manifests, which tools
        # print: a control character (a NUL from a C string) would make a key nobody
        # else computes and a manifest that garbles a report.
        if (
            not isinstance(self.dtype, str)
            or not self.dtype
            or not self.dtype.isascii()
            or not self.dtype.isprintable()
            or any(c in " /|" for c in self.dtype)
        ):
            raise LayoutError(
                f"role {self.name!r}: dtype {self.dtype!r} must be non-empty printable "
                "ASCII without spaces, '/' or '|' (like 'bf16' or 'fp8_e4m3+scale')"
            )

    @property
    def replicated(self) -> bool:
        return self.units == 1


def _int(value: object, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{where}: {what} must be an int, got {value!r}")
    return value


def _items(value: object, what: str, where: str) -> tuple[object, ...]:
    """A tuple/list field as a tuple; anything else (None, a string, a number) is refused."""
    # Sets and mappings are refused too: their order is not declared, and the order of
    # regions is the page's byte order, which every rank must agree on.
    if isinstance(value, (str, bytes, AbstractSet, Mapping)) or not isinstance(value, Iterable):
        raise LayoutError(f"{where}: {what} must be a tuple or list, got {value!r:.80}")
    return tuple(value)


def _positive_int(value: object, what: str, where: str, *, allow_zero: bool = False) -> int:
    value = _int(value, what, where)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise LayoutError(f"{where}: {what} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class UnitLayout:
    """How one slot of a region splits by the role's units (KV heads): its ``size`` bytes
    are ``[outer][units][inner]``.

    ``units`` is how many of the role's units this rank's region holds; ``inner`` the
    contiguous bytes of one unit at one ``outer`` index. vLLM's CPU cache, a slot
    ``[heads, block_size, 2 * head_dim]``, is ``outer = 1`` (each head's bytes are
    contiguous); a token-major slot ``[block_size, heads, head_dim]`` is ``outer =
    block_size``. Pages cut at a finer head granularity than the rank's own
    (``shard_heads``) need it: it is what says which bytes of a slot belong to which
    heads. The bytes of a subset of the units are, canonically, ``[outer][subset][inner]``.
    """

    units: int
    inner: int
    outer: int = 1

    def __post_init__(self) -> None:
        for name in ("units", "inner", "outer"):
            _positive_int(getattr(self, name), name, "unit layout")

    @property
    def size(self) -> int:
        """Bytes of one slot the layout describes."""
        return self.outer * self.units * self.inner


@dataclass(frozen=True)
class Region:
    """A strided byte range of a pool: slot ``i`` is ``base + i*stride`` for ``size`` bytes.

    ``base`` is a byte offset from the start of pool number ``pool``, not an absolute
    address, so descriptions survive re-allocation and can be compared across ranks.

    ``unit_layout`` (optional) says how a slot's bytes split by the role's units; only
    pages cut finer than the rank's own shard (``shard_heads``) need it.
    """

    role: str
    layer: int
    base: int
    size: int
    stride: int
    num_slots: int
    pool: int = 0
    unit_layout: UnitLayout | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, str):
            raise LayoutError(f"a region's role must be a role name, got {self.role!r}")
        where = self.label
        _positive_int(self.layer, "layer", where, allow_zero=True)
        _positive_int(self.base, "base", where, allow_zero=True)
        _positive_int(self.size, "size", where)
        _positive_int(self.num_slots, "num_slots", where)
        _positive_int(self.pool, "pool", where, allow_zero=True)
        _positive_int(self.stride, "stride", where, allow_zero=self.num_slots == 1)
        if self.num_slots > 1 and self.stride < self.size:
            raise LayoutError(
                f"{where}: stride {self.stride} is smaller than size {self.size}, "
                "so consecutive slots of the region overlap"
            )
        units = self.unit_layout
        if units is not None:
            if not isinstance(units, UnitLayout):
                raise LayoutError(f"{where}: unit_layout must be a UnitLayout, got {units!r:.80}")
            if units.size != self.size:
                raise LayoutError(
                    f"{where}: its unit layout [outer {units.outer}][units {units.units}]"
                    f"[inner {units.inner}] is {units.size} bytes, the region's slot {self.size}"
                )

    def part(self, parts: int, index: int) -> tuple[Region, ...]:
        """The regions holding the ``index``-th of ``parts`` equal runs of this region's
        units, in the canonical order ``[outer][units of the part][inner]``.

        One region when each unit's bytes are contiguous (``outer == 1``), else one per
        outer index (:func:`kvconn.movement.compile_runs` folds them into one run). So
        the part of a region holding several heads is byte for byte the region of a rank
        that holds only those heads: pages cut at a head granularity finer than the
        rank's own are the same pages whichever TP size cut them.
        """
        if parts == 1 and index == 0:
            return (self,)
        where = self.label
        units = self.unit_layout
        if units is None:
            raise LayoutError(
                f"{where}: splitting it into {parts} pages needs its unit layout (which "
                "bytes of a slot hold which heads); the engine adapter must describe it "
                "(Region.unit_layout)"
            )
        if parts < 1 or not 0 <= index < parts or units.units % parts:
            raise LayoutError(
                f"{where}: its {units.units} units cannot be cut into {parts} equal parts "
                f"(part {index} asked)"
            )
        per_part = units.units // parts
        size = per_part * units.inner
        first = self.base + index * size
        piece = UnitLayout(per_part, units.inner)
        return tuple(
            Region(
                self.role,
                self.layer,
                first + o * units.units * units.inner,
                size,
                self.stride,
                self.num_slots,
                self.pool,
                piece,
            )
            for o in range(units.outer)
        )

    @property
    def label(self) -> str:
        return f"region {self.role}@layer{self.layer}"

    @property
    def end(self) -> int:
        """One past the last byte any slot of the region touches."""
        return self.base + (self.num_slots - 1) * self.stride + self.size

    @classmethod
    def from_tensor(
        cls,
        role: str,
        layer: int,
        view: torch.Tensor,
        pool: torch.Tensor,
        pool_index: int = 0,
        unit_dim: int | None = None,
    ) -> Region:
        """Describe ``view`` (slots along dim 0) as a region of ``pool``.

        Each slot's bytes must be contiguous; that is what makes a page a plain byte
        concatenation that any backend can store. ``unit_dim`` names the dimension of
        ``view`` that indexes the role's units (KV heads), from which the region's
        :class:`UnitLayout` follows: e.g. ``1`` for ``[slots, heads, block_size, dim]``,
        ``2`` for ``[slots, block_size, heads, dim]``.
        """
        where = f"region {role}@layer{layer}"
        for name, tensor in (("view", view), ("pool", pool)):
            if not all(hasattr(tensor, a) for a in ("dim", "device", "data_ptr", "stride")):
                raise LayoutError(f"{where}: {name} must be a torch.Tensor, got {tensor!r:.80}")
        if view.dim() < 1:
            raise LayoutError(f"{where}: the tensor needs a slot dimension (dim 0)")
        if view.numel() == 0:
            # Checked first: an empty view has no byte to place inside the pool, and
            # "does not lie inside the pool" would send the reader looking elsewhere.
            raise LayoutError(
                f"{where}: the tensor is empty (shape {tuple(view.shape)}); a region "
                "needs at least one slot of at least one byte"
            )
        if view.device != pool.device:
            raise LayoutError(f"{where}: tensor is on {view.device}, its pool on {pool.device}")
        if not view[0].is_contiguous():
            raise LayoutError(f"{where}: the bytes of one slot are not contiguous")
        elsize = view.element_size()
        offset = view.data_ptr() - pool.data_ptr()
        pool_bytes = pool.numel() * pool.element_size()
        if offset < 0 or offset >= pool_bytes:
            raise LayoutError(f"{where}: the tensor does not lie inside pool {pool_index}")
        size = view[0].numel() * elsize
        units = None
        if unit_dim is not None:
            if isinstance(unit_dim, bool) or not isinstance(unit_dim, int):
                raise LayoutError(f"{where}: unit_dim must be a dimension index, got {unit_dim!r}")
            if not 1 <= unit_dim < view.dim():
                raise LayoutError(
                    f"{where}: unit_dim {unit_dim} is not a dimension after the slot "
                    f"dimension of a tensor of shape {tuple(view.shape)}"
                )
            shape = tuple(view.shape)
            units = UnitLayout(
                units=shape[unit_dim],
                inner=math.prod(shape[unit_dim + 1 :]) * elsize,
                outer=math.prod(shape[1:unit_dim]),
            )
        return cls(
            role=role,
            layer=layer,
            base=offset,
            size=size,
            stride=view.stride(0) * elsize,
            num_slots=view.shape[0],
            pool=pool_index,
            unit_layout=units,
        )


@dataclass(frozen=True)
class Chunked:
    """The window of chunked local attention (Llama 4's ``attention_chunk_size``): the
    tokens are cut into chunks of ``blocks`` blocks, and a token attends only to the
    tokens of its own chunk before it. A reader that resumes after ``N`` blocks needs the
    group's pages of blocks ``[N - N % blocks, N)``: none at all where ``N`` ends a chunk.
    """

    blocks: int

    def __post_init__(self) -> None:
        _positive_int(self.blocks, "blocks (per attention chunk)", "chunked window")


#: Which blocks before the end of a hit a layer group's pages are needed for: ``None``
#: every one, an ``int`` ``W`` the last ``W`` (a sliding window), or :class:`Chunked`.
Window: TypeAlias = int | Chunked | None


def window_start(window: Window, blocks: int) -> int:
    """The first block whose pages of a group with ``window`` a reader resuming after
    ``blocks`` blocks needs (``blocks`` itself: none of them)."""
    if window is None:
        return 0
    if isinstance(window, Chunked):
        return blocks - blocks % window.blocks
    return max(0, blocks - window)


#: A slot argument of ``save`` / ``load`` meaning "this layer group has no slot for this
#: block" (vLLM's null block, outside a sliding window): that page is neither saved nor
#: loaded, and a load does not count it against the block.
NO_SLOT = -1


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one block table, hence one slot numbering for all their regions.

    The order of ``regions`` is the declared page order: a page is the concatenation of
    the rank's regions of one shard class in exactly this order.

    ``window`` is for sliding-window layers: a reader that resumes after ``N`` blocks
    needs this group's pages only for the last ``window`` of them, blocks
    ``[max(0, N - window), N)``, because the layers never attend further back. ``None``
    (full attention) needs every block; :class:`Chunked` the blocks of the attention
    chunk ``N`` ends in. It changes which pages a hit needs, not what a page holds, so it
    is not part of any key: a windowed reader and a full one share pages.
    """

    index: int
    num_slots: int
    regions: tuple[Region, ...]
    name: str = ""
    window: Window = None

    def __post_init__(self) -> None:
        _positive_int(self.index, "index", "layer group", allow_zero=True)
        if not isinstance(self.name, str):
            raise LayoutError(f"layer group {self.index}: name must be a string, got {self.name!r}")
        if unprintable(self.name) is not None:
            # the name is in every error about the group, and travels in to_dict()
            raise LayoutError(
                f"layer group {self.index}: name {self.name!r} must be printable text, "
                "without control or invisible characters"
            )
        where = self.label
        if self.window is not None and not isinstance(self.window, Chunked):
            _positive_int(self.window, "window (blocks, Chunked, or None)", where)
        object.__setattr__(self, "regions", _items(self.regions, "regions", where))
        _positive_int(self.num_slots, "num_slots", where)
        if not self.regions:
            raise LayoutError(f"{where}: has no regions")
        seen: set[tuple[int, str]] = set()
        for region in self.regions:
            if not isinstance(region, Region):
                raise LayoutError(f"{where}: {region!r} is not a Region")
            if region.num_slots != self.num_slots:
                raise LayoutError(
                    f"{where}, {region.label}: has its own slot count {region.num_slots}; "
                    f"every region of the group has the group's {self.num_slots} slots"
                )
            ident = (region.layer, region.role)
            if ident in seen:
                raise LayoutError(f"{where}: {region.label} is declared twice")
            seen.add(ident)

    @property
    def label(self) -> str:
        return f"layer group {self.index}" + (f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class KvLayout:
    """The whole KV-cache geometry of one rank, identical in shape on every rank."""

    tp_size: int
    tokens_per_block: int
    roles: tuple[Role, ...]
    groups: tuple[LayerGroup, ...]
    pool_sizes: tuple[int, ...]
    _roles_by_name: dict[str, Role] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("roles", "groups", "pool_sizes"):
            object.__setattr__(self, name, _items(getattr(self, name), name, "layout"))
        _positive_int(self.tp_size, "tp_size", "layout")
        _positive_int(self.tokens_per_block, "tokens_per_block", "layout")
        by_name: dict[str, Role] = {}
        for role in self.roles:
            if not isinstance(role, Role):
                raise LayoutError(f"layout: roles must be Role objects, got {role!r}")
            if role.name in by_name:
                raise LayoutError(f"layout: role {role.name!r} is declared twice")
            by_name[role.name] = role
            shard_position(0, self.tp_size, role.units)  # raises on inconsistent units
        object.__setattr__(self, "_roles_by_name", by_name)
        if not self.groups:
            raise LayoutError("layout: has no layer groups")
        for group in self.groups:
            if not isinstance(group, LayerGroup):
                raise LayoutError(f"layout: groups must be LayerGroup objects, got {group!r:.80}")
        for i, size in enumerate(self.pool_sizes):
            _positive_int(size, f"pool_sizes[{i}]", "layout")
        indices = [g.index for g in self.groups]
        if len(set(indices)) != len(indices):
            raise LayoutError(f"layout: layer group indices repeat: {indices}")
        for group in self.groups:
            for region in group.regions:
                if region.role not in by_name:
                    known = ", ".join(sorted(by_name)) or "none"
                    raise LayoutError(
                        f"{group.label}, {region.label}: unknown role {region.role!r} "
                        f"(declared roles: {known})"
                    )
                if region.pool >= len(self.pool_sizes):
                    raise LayoutError(
                        f"{group.label}, {region.label}: pool {region.pool} does not exist "
                        f"(the layout declares {len(self.pool_sizes)} pools)"
                    )
                units = region.unit_layout
                if units is not None:
                    role = by_name[region.role]
                    local = role.units // shard_position(0, self.tp_size, role.units).num_shards
                    if units.units != local:
                        raise LayoutError(
                            f"{group.label}, {region.label}: its unit layout holds "
                            f"{units.units} units, but role {role.name!r} ({role.units} "
                            f"units at TP={self.tp_size}) puts {local} on each rank"
                        )
                if region.end > self.pool_sizes[region.pool]:
                    raise LayoutError(
                        f"{group.label}, {region.label}: slots out of bounds: its last slot "
                        f"ends at byte {region.end} of pool {region.pool}, which has "
                        f"{self.pool_sizes[region.pool]} bytes"
                    )
        _check_no_overlap(self.groups)

    def role(self, name: str) -> Role:
        return self._roles_by_name[name]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description that :meth:`from_dict` turns back into an equal layout.

        A process that holds no KV tensors (an engine's scheduler) needs the layout only
        to plan keys; shipping this dict from a worker, or deriving it from the engine's
        configuration, gives it one without tensors or torch.
        """
        return {
            "version": LAYOUT_DICT_VERSION,
            "tp_size": self.tp_size,
            "tokens_per_block": self.tokens_per_block,
            "roles": [_record(role) for role in self.roles],
            "groups": [
                {
                    "index": g.index,
                    "num_slots": g.num_slots,
                    "name": g.name,
                    "window": _window_record(g.window),
                    "regions": [_region_record(r) for r in g.regions],
                }
                for g in self.groups
            ],
            "pool_sizes": list(self.pool_sizes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KvLayout:
        """The layout :meth:`to_dict` described, validated like any other layout.

        Unknown or missing fields are a :class:`LayoutError` naming them, so a dict from
        a newer or older kvconn is refused instead of half-read.
        """
        doc = _fields_of(data, "layout", _LAYOUT_FIELDS)
        if doc["version"] not in (3, LAYOUT_DICT_VERSION):
            raise LayoutError(
                f"layout: version {doc['version']!r} is not 3 or {LAYOUT_DICT_VERSION} "
                "(written by another kvconn release?)"
            )
        roles = [
            Role(**_fields_of(r, f"layout.roles[{i}]", _ROLE_FIELDS))
            for i, r in enumerate(_list_of(doc["roles"], "layout.roles"))
        ]
        groups = []
        for i, raw in enumerate(_list_of(doc["groups"], "layout.groups")):
            g = _fields_of(raw, f"layout.groups[{i}]", _GROUP_FIELDS)
            regions = tuple(
                _region_from(r, f"layout.groups[{i}].regions[{j}]")
                for j, r in enumerate(_list_of(g["regions"], f"layout.groups[{i}].regions"))
            )
            if not isinstance(g["name"], str):
                raise LayoutError(f"layout.groups[{i}]: name must be a string, got {g['name']!r}")
            window = _window_from(g["window"], f"layout.groups[{i}]")
            groups.append(LayerGroup(g["index"], g["num_slots"], regions, g["name"], window))
        return cls(
            tp_size=doc["tp_size"],
            tokens_per_block=doc["tokens_per_block"],
            roles=tuple(roles),
            groups=tuple(groups),
            pool_sizes=tuple(_list_of(doc["pool_sizes"], "layout.pool_sizes")),
        )

    def group(self, index: int) -> LayerGroup:
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(index)


#: Version of :meth:`KvLayout.to_dict`'s form; a reader refuses any other but 3, which
#: this one extends. Version 2 added each group's ``window``, version 3 each region's
#: ``unit_layout``, version 4 a chunked window (``{"chunk_blocks": N}``).
LAYOUT_DICT_VERSION = 4
_ROLE_FIELDS = ("name", "units", "dtype")
_REGION_FIELDS = ("role", "layer", "base", "size", "stride", "num_slots", "pool", "unit_layout")
_UNIT_FIELDS = ("units", "inner", "outer")
_GROUP_FIELDS = ("index", "num_slots", "name", "window", "regions")
_LAYOUT_FIELDS = ("version", "tp_size", "tokens_per_block", "roles", "groups", "pool_sizes")


def _window_record(window: Window) -> int | dict[str, int] | None:
    if isinstance(window, Chunked):
        return {"chunk_blocks": window.blocks}
    return window


def _window_from(raw: Any, where: str) -> Window:
    if isinstance(raw, Mapping):
        return Chunked(_fields_of(raw, f"{where}.window", ("chunk_blocks",))["chunk_blocks"])
    return raw  # type: ignore[no-any-return]  # LayerGroup validates it


def _record(item: Role | Region | UnitLayout) -> dict[str, Any]:
    return {f.name: getattr(item, f.name) for f in fields(item)}


def _region_record(region: Region) -> dict[str, Any]:
    record = _record(region)
    if region.unit_layout is not None:
        record["unit_layout"] = _record(region.unit_layout)
    return record


def _region_from(data: object, where: str) -> Region:
    doc = _fields_of(data, where, _REGION_FIELDS)
    if doc["unit_layout"] is not None:
        doc["unit_layout"] = UnitLayout(
            **_fields_of(doc["unit_layout"], f"{where}.unit_layout", _UNIT_FIELDS)
        )
    return Region(**doc)


def _fields_of(data: object, where: str, names: Sequence[str]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise LayoutError(f"{where}: must be an object/dict, got {type(data).__name__}")
    missing = [n for n in names if n not in data]
    unknown = sorted(str(k) for k in data if k not in names)
    if missing or unknown:
        raise LayoutError(f"{where}: missing field(s) {missing}, unknown field(s) {unknown}")
    return {n: data[n] for n in names}


def _list_of(value: object, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise LayoutError(f"{where}: must be a list, got {type(value).__name__}")
    return list(value)


def _strided_overlap(a: Region, b: Region) -> bool:
    """Whether any slot of ``a`` shares a byte with any slot of ``b`` (same pool)."""
    if a.end <= b.base or b.end <= a.base:
        return False
    # The analytic path assumes no slot is longer than the stride, which only a
    # one-slot region may violate; such pairs take the exact interval check.
    if a.stride == b.stride and a.stride >= max(a.size, b.size):
        # Slot i of a vs slot j of b: they overlap iff -b.size < (b.base - a.base) + k*s
        # < a.size with k = j - i. Both sizes are <= s, so only k near the crossing can.
        s = a.stride
        delta = b.base - a.base
        k0 = (-delta) // s
        span = max(a.num_slots, b.num_slots) - 1
        for k in range(k0 - 1, k0 + 3):
            if -span <= k <= span:
                d = delta + k * s
                # slot pairs exist with j - i = k only within both slot ranges
                if max(0, -k) <= min(a.num_slots - 1, b.num_slots - 1 - k) and (
                    -b.size < d < a.size
                ):
                    return True
        return False
    return _interval_overlap(a, b)


def _interval_overlap(a: Region, b: Region) -> bool:
    """Exact check for regions of different strides, in O(min(slots)) without arrays.

    For each slot of the region with fewer slots, only the first slot of the other
    region that ends after it starts can overlap it: later ones start later still,
    because a region with more than one slot has ``size <= stride``.
    """
    if a.num_slots > b.num_slots:
        a, b = b, a
    for i in range(a.num_slots):
        start = a.base + i * a.stride
        # the first j with b.base + j*stride + size > start
        j = 0 if b.num_slots == 1 else max(0, (start - b.base - b.size) // b.stride + 1)
        if (
            j < b.num_slots
            and b.base + j * b.stride < start + a.size
            and (b.base + j * b.stride + b.size > start)
        ):
            return True
    return False


def _check_no_overlap(groups: Iterable[LayerGroup]) -> None:
    placed: list[tuple[LayerGroup, Region]] = [(g, r) for g in groups for r in g.regions]
    by_pool: dict[int, list[tuple[LayerGroup, Region]]] = {}
    for item in placed:
        by_pool.setdefault(item[1].pool, []).append(item)
    for items in by_pool.values():
        items.sort(key=lambda gr: gr[1].base)
        for (ga, a), (gb, b) in _candidate_pairs(items):
            if _strided_overlap(a, b):
                raise LayoutError(
                    f"{ga.label}, {a.label} overlaps {gb.label}, {b.label} in pool {a.pool}"
                )


def _candidate_pairs(
    items: Sequence[tuple[LayerGroup, Region]],
) -> Iterable[tuple[tuple[LayerGroup, Region], tuple[LayerGroup, Region]]]:
    """Pairs whose byte spans intersect; items are sorted by base."""
    for i, first in enumerate(items):
        end = first[1].end
        for second in items[i + 1 :]:
            if second[1].base >= end:
                break
            yield first, second
