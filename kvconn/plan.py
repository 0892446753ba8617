"""Page planning: which pages exist, what each holds, who loads and who writes it.

All pure functions of the layout (and of a rank and a block hash), so that every rank,
and the scheduler that has no rank at all, derive the same answers without talking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvconn.errors import ConfigError
from kvconn.integrity import DEFAULT as DEFAULT_CHECKSUM
from kvconn.integrity import PageChecksum
from kvconn.keys import page_key, page_key_stem, shard_component
from kvconn.layout import Chunked, KvLayout, Region, Window, shard_position, window_start
from kvconn.manifest import PageManifest


class WriterPolicy(str, Enum):
    """Which replica writes a page that several ranks hold identically."""

    SPREAD = "spread"  # chosen from the block hash: write bandwidth balances across ranks
    FIRST = "first"  # replica 0 always writes: simple, but rank 0 carries the extra load
    #: The engine picks the saving rank itself (SGLang saves MLA pages from rank 0 only):
    #: the rank that saves writes every page it holds, so no page waits on a rank that
    #: will never save it. Pages already stored are still skipped.
    ALL = "all"

    @classmethod
    def parse(cls, value: str | WriterPolicy) -> WriterPolicy:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ConfigError(f"unknown writer_policy {value!r}; choose one of: {names}") from None


@dataclass(frozen=True)
class ShardClass:
    """Roles whose bytes split the same way across ranks.

    ``num_shards is None`` is the replicated class (units == 1): one page for the whole
    group at any TP size.
    """

    num_shards: int | None

    @property
    def replicated(self) -> bool:
        return self.num_shards is None

    @property
    def label(self) -> str:
        return "replicated" if self.num_shards is None else f"w{self.num_shards}"

    def component(self, shard_index: int) -> str:
        return shard_component(self.num_shards, shard_index)

    @property
    def shard_count(self) -> int:
        return 1 if self.num_shards is None else self.num_shards


def page_manifest(
    layout: KvLayout,
    cls: ShardClass,
    regions: Sequence[Region],
    checksum: str = DEFAULT_CHECKSUM,
    parts: int = 1,
) -> PageManifest:
    """The description of a page kind; its fingerprint and its stored manifest both derive
    from this, and nothing else.

    Placement in memory (base, stride, pool) is left out on purpose: it does not change
    the bytes, and engines with different allocators must still share pages.

    ``parts``: pages per block a rank cuts its ``regions`` into (``shard_heads``). Each
    region counts once, with its share of the bytes, however many pieces of memory that
    share is made of: so a page of one head shard has the same manifest, hence the same
    key, whether a rank holding just those heads wrote it or a rank holding more.
    """
    names = sorted({r.role for r in regions})
    return PageManifest(
        tokens_per_block=layout.tokens_per_block,
        shard_class=cls.label,
        roles=tuple((n, layout.role(n).units, layout.role(n).dtype) for n in names),
        regions=tuple((r.layer, r.role, r.size // parts) for r in regions),
        checksum=PageChecksum(checksum).name,
    )


@dataclass(frozen=True)
class PagePlan:
    """One kind of page: a layer group's regions of one shard class, in declared order.

    A rank holds ``parts`` pages of the kind per block: one, unless ``shard_heads`` cuts
    pages finer than the rank's own shard, when each page holds an equal run of the
    regions' units (``part_regions``).
    """

    group: int
    shard_class: ShardClass
    regions: tuple[Region, ...]  # the rank's whole regions of the class
    page_size: int  # payload bytes of one page; a stored value is ``value_size``
    fingerprint: str
    role_bytes: tuple[tuple[str, int], ...]  # bytes of each role in one page
    manifest: PageManifest  # what the fingerprint hashes; stored as the layout manifest
    checksum: PageChecksum  # the trailer after each stored page
    #: Per page the rank holds of this kind in a block, the strided regions it is made
    #: of, in page order (:meth:`Region.part`); ``(regions,)`` when pages are the rank's
    #: own shard.
    part_regions: tuple[tuple[Region, ...], ...]
    #: The group's window in blocks (``LayerGroup.window``): which blocks a hit needs
    #: this page kind for. Not in the fingerprint: it does not change a page's bytes.
    window: Window = None

    @property
    def parts(self) -> int:
        """Pages of this kind a rank holds per block."""
        return len(self.part_regions)

    @property
    def value_size(self) -> int:
        """Bytes of a stored value: the page, then its checksum trailer."""
        return self.page_size + self.checksum.size

    @property
    def label(self) -> str:
        return f"lg{self.group}/{self.shard_class.label}"


def plan_pages(
    layout: KvLayout, checksum: str = DEFAULT_CHECKSUM, shard_heads: int | None = None
) -> tuple[PagePlan, ...]:
    """Every page kind of the layout, groups in declared order, replicated class last.

    ``checksum`` names the trailer stored after each page (:mod:`kvconn.integrity`); it
    is part of every fingerprint, so it must be the same wherever keys are made (the
    scheduler's lookup and every rank).

    ``shard_heads`` (``G``): every head-sharded page is cut at ``G`` shards of its
    role's units, ``w<G>r<j>``, whatever the TP size, so that TP sizes dividing ``G``
    share pages (:func:`shard_parts` says what is refused). ``None``: each TP size cuts
    pages at its own shard, ``w<min(tp, units)>r<i>``. The replicated class is the same
    either way.
    """
    scheme = PageChecksum(checksum)
    plans: list[PagePlan] = []
    for group in layout.groups:
        classes: dict[ShardClass, list[Region]] = {}
        for region in group.regions:
            role = layout.role(region.role)
            if role.replicated:
                cls = ShardClass(None)
            elif shard_heads is not None:
                shard_parts(layout, role.name, shard_heads)  # refuses a G that cannot work
                cls = ShardClass(shard_heads)
            else:
                cls = ShardClass(shard_position(0, layout.tp_size, role.units).num_shards)
            classes.setdefault(cls, []).append(region)
        ordered = sorted(classes, key=lambda c: (c.replicated, c.num_shards or 0))
        for cls in ordered:
            regions = classes[cls]
            parts = 1 if cls.replicated else shard_parts(layout, regions[0].role, cls.shard_count)
            role_bytes: dict[str, int] = {}
            for r in regions:
                role_bytes[r.role] = role_bytes.get(r.role, 0) + r.size // parts
            manifest = page_manifest(layout, cls, regions, scheme.name, parts)
            plans.append(
                PagePlan(
                    group=group.index,
                    shard_class=cls,
                    regions=tuple(regions),
                    page_size=manifest.page_size,
                    fingerprint=manifest.fingerprint,
                    role_bytes=tuple(role_bytes.items()),
                    manifest=manifest,
                    checksum=scheme,
                    part_regions=tuple(
                        tuple(piece for r in regions for piece in r.part(parts, k))
                        for k in range(parts)
                    ),
                    window=group.window,
                )
            )
    return tuple(plans)


def shard_parts(layout: KvLayout, role_name: str, shards: int) -> int:
    """Pages per block a rank holds of a role cut at ``shards`` shards of its units.

    ``shards`` must divide the role's units (a page holds whole heads) and be a multiple
    of the rank's own shard count, ``min(tp_size, units)`` (a page's heads lie on one
    rank): anything else is a :class:`ConfigError` naming both numbers.
    """
    role = layout.role(role_name)
    own = shard_position(0, layout.tp_size, role.units).num_shards
    if role.units % shards:
        raise ConfigError(
            f"shard_heads={shards} does not divide role {role.name!r}'s {role.units} units "
            "(KV heads): a page holds whole heads; choose a divisor of every sharded role's "
            "units"
        )
    if shards % own:
        raise ConfigError(
            f"shard_heads={shards} is not a multiple of TP={layout.tp_size}'s {own} shards "
            f"of role {role.name!r} ({role.units} units): a TP size that shares pages cut "
            f"at {shards} shards must divide {shards}"
        )
    return shards // own


@dataclass(frozen=True)
class RankShare:
    """A rank's relation to one page: which shard it holds, among how many copies.

    ``shard_index`` is the page's shard (``r<j>`` of its key). A rank holds ``parts``
    consecutive shards of a kind cut finer than its own shard (``shard_heads``); ``part``
    says which of them this is.
    """

    plan: PagePlan
    shard_index: int
    replica_index: int
    dup: int
    part: int = 0

    @property
    def regions(self) -> tuple[Region, ...]:
        """The strided regions this page is gathered from and scattered to."""
        return self.plan.part_regions[self.part]

    @property
    def rank_shard(self) -> int:
        """The TP shard whose ``dup`` replicas (ranks ``rank_shard * dup`` on) hold it."""
        return self.shard_index // self.plan.parts


def rank_shares(layout: KvLayout, plans: Sequence[PagePlan], rank: int) -> tuple[RankShare, ...]:
    """Per page this rank holds of a block, the shard it loads and its replica position
    for writing: one per page kind, or ``parts`` consecutive ones of a kind cut finer
    than the rank's shard."""
    shares = []
    for plan in plans:
        units = 1 if plan.shard_class.replicated else layout.role(plan.regions[0].role).units
        pos = shard_position(rank, layout.tp_size, units)
        for part in range(plan.parts):
            j = pos.shard_index * plan.parts + part
            shares.append(RankShare(plan, j, pos.replica_index, pos.dup, part))
    return tuple(shares)


def writes(share: RankShare, block_hash: bytes, policy: WriterPolicy) -> bool:
    """Whether the rank holding ``share`` is a designated writer of this block's page."""
    if policy is WriterPolicy.ALL:
        return True
    return writer_replica(block_hash, share.dup, policy) == share.replica_index


def writer_replica(block_hash: bytes, dup: int, policy: WriterPolicy) -> int:
    """The replica index that writes a page of this block (``spread`` and ``first``).

    Under ``all`` every replica that saves writes; this names replica 0, the one that
    ``first`` would pick, for callers that need a single index.

    The block hash is already a uniform cryptographic digest, so its low bits spread
    blocks evenly over replicas without another hash.
    """
    if dup == 1 or policy is not WriterPolicy.SPREAD:
        return 0
    return int.from_bytes(block_hash[:8], "little") % dup


def lookup_keys(
    prefix: str, plans: Sequence[PagePlan], block_hashes: Sequence[bytes]
) -> list[list[str]]:
    """For each block, the keys of every page *any* rank will load: all shards, all groups."""
    # the stems once, then each key is a stem and the block's hash: a scheduler asks this
    # of every prompt, so its cost per key is its cost per block
    stems = [
        page_key_stem(prefix, plan.shard_class.component(j), plan.group, plan.fingerprint)
        for plan in plans
        for j in range(plan.shard_class.shard_count)
    ]
    return [[stem + h for stem in stems] for h in (b.hex() for b in block_hashes)]


def lookup_windows(
    plans: Sequence[PagePlan], groups: Mapping[int, Window] | None = None
) -> list[Window]:
    """The window (blocks, :class:`~kvconn.layout.Chunked`, or ``None``) of each key
    :func:`lookup_keys` lists for one block, in the same order: what
    :func:`count_prefix_hit` needs to apply windows. ``groups`` gives each layer group's
    window instead of its plans' (one lookup's)."""
    return [
        p.window if groups is None else groups[p.group]
        for p in plans
        for _ in range(p.shard_class.shard_count)
    ]


def count_prefix_hit(
    per_block_present: Sequence[Sequence[bool]],
    windows: Sequence[Window] | None = None,
) -> int:
    """The hit in blocks: the largest ``N`` whose every needed page is present (rule 3).

    ``per_block_present[i][j]`` says whether page ``j`` of block ``i`` is stored (the
    pages of a block in :func:`lookup_keys` order); ``windows[j]`` is page ``j``'s window
    (:func:`lookup_windows`). A page without a window is needed for every block
    ``[0, N)``; one with window ``W`` only for ``[max(0, N - W), N)``, so a sliding-window
    group's evicted early pages do not shorten the hit, and one with ``Chunked(K)`` for
    ``[N - N % K, N)`` (:func:`~kvconn.layout.window_start`). Without windows this is the
    longest prefix of blocks whose every page is present.

    With windows the answer is not a prefix property: ``N`` may be a hit while ``N - 1``
    is not (a missing windowed page that ``N``'s window has left behind), as in vLLM's
    own sliding-window cache hit, hence the scan over every ``N``
    (:func:`restorable_prefixes` lists them all).
    """
    if _windowless(windows):
        return _full_prefix(per_block_present, windows)
    return max(restorable_prefixes(per_block_present, windows), default=0)


def restorable_prefixes(
    per_block_present: Sequence[Sequence[bool]],
    windows: Sequence[Window] | None = None,
) -> list[int]:
    """Every ``N >= 1``, ascending, whose every needed page is present (as
    :func:`count_prefix_hit`, which is the largest of them).

    An engine that resumes from the last page of a hit only (SGLang's sliding-window and
    state pools, ``restorable_prefix_pages``) needs them all: with windows, ``N`` and
    ``N + 2`` may be hits while ``N + 1`` is not, and the ranks of a TP group agree on
    a hit by intersecting these lists, which taking the smallest of their largest ``N``
    would get wrong. Without windows they are ``1`` to the longest fully stored prefix.
    """
    if _windowless(windows):
        return list(range(1, _full_prefix(per_block_present, windows) + 1))
    assert windows is not None
    last_missing = [-1] * len(windows)  # per page: the last block before N without it
    found: list[int] = []
    for n, present in enumerate(per_block_present, start=1):
        _check_page_count(n - 1, present, windows)
        for j, there in enumerate(present):
            if not there:
                last_missing[j] = n - 1
        if any(last_missing[j] >= 0 for j, w in enumerate(windows) if w is None):
            break  # a full page is missing: no longer prefix can be a hit either
        windowed = ((j, w) for j, w in enumerate(windows) if w is not None)
        if all(last_missing[j] < window_start(w, n) for j, w in windowed):
            found.append(n)
    return found


def _windowless(windows: Sequence[Window] | None) -> bool:
    """Whether no page has a window (checking that each window is one)."""
    if windows is None:
        return True
    if any(
        w is not None
        and not isinstance(w, Chunked)
        and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
        for w in windows
    ):
        raise ValueError(f"windows must be None, ints >= 1 or Chunked, got {list(windows)}")
    return all(w is None for w in windows)


def _full_prefix(
    per_block_present: Sequence[Sequence[bool]], windows: Sequence[Window] | None
) -> int:
    """The longest prefix of blocks whose every page is present."""
    hit = 0
    for present in per_block_present:
        if windows is not None:
            _check_page_count(hit, present, windows)
        if not all(present):
            break
        hit += 1
    return hit


def _check_page_count(block: int, present: Sequence[bool], windows: Sequence[Window]) -> None:
    if len(present) != len(windows):
        raise ValueError(f"block {block} has {len(present)} pages, windows name {len(windows)}")


def share_key(prefix: str, share: RankShare, block_hash: bytes) -> str:
    plan = share.plan
    return page_key(
        prefix,
        plan.shard_class.component(share.shard_index),
        plan.group,
        plan.fingerprint,
        block_hash,
    )
