"""Page planning: which pages exist, what each holds, who loads and who writes it.

All pure functions of the layout (and of a rank and a block hash), so that every rank,
and the scheduler that has no rank at all, derive the same answers without talking.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvconn.errors import ConfigError
from kvconn.keys import page_key, shard_component
from kvconn.layout import KvLayout, Region, shard_position


class WriterPolicy(str, Enum):
    """Which replica writes a page that several ranks hold identically."""

    SPREAD = "spread"  # chosen from the block hash: write bandwidth balances across ranks
    FIRST = "first"  # replica 0 always writes: simple, but rank 0 carries the extra load

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


@dataclass(frozen=True)
class PagePlan:
    """One kind of page: a layer group's regions of one shard class, in declared order."""

    group: int
    shard_class: ShardClass
    regions: tuple[Region, ...]
    page_size: int
    fingerprint: str
    role_bytes: tuple[tuple[str, int], ...]  # bytes of each role in one page

    @property
    def label(self) -> str:
        return f"lg{self.group}/{self.shard_class.label}"


def _fingerprint(layout: KvLayout, cls: ShardClass, regions: Sequence[Region]) -> str:
    """Geometry and meaning of a page, short enough for a key segment.

    Placement in memory (base, stride, pool) is left out on purpose: it does not change
    the bytes, and engines with different allocators must still share pages.
    """
    page_size = sum(r.size for r in regions)
    roles = sorted({r.role for r in regions})
    meaning = {
        "v": 1,
        "tokens_per_block": layout.tokens_per_block,
        "class": cls.label,
        "roles": {n: [layout.role(n).units, layout.role(n).dtype] for n in roles},
        "regions": [[r.layer, r.role, r.size] for r in regions],
    }
    digest = hashlib.blake2b(
        json.dumps(meaning, sort_keys=True).encode(), digest_size=6, person=b"kvconn-layout"
    ).hexdigest()
    return f"t{layout.tokens_per_block}b{page_size}-{digest}"


def plan_pages(layout: KvLayout) -> tuple[PagePlan, ...]:
    """Every page kind of the layout, groups in declared order, replicated class last."""
    plans: list[PagePlan] = []
    for group in layout.groups:
        classes: dict[ShardClass, list[Region]] = {}
        for region in group.regions:
            role = layout.role(region.role)
            if role.replicated:
                cls = ShardClass(None)
            else:
                cls = ShardClass(shard_position(0, layout.tp_size, role.units).num_shards)
            classes.setdefault(cls, []).append(region)
        ordered = sorted(classes, key=lambda c: (c.replicated, c.num_shards or 0))
        for cls in ordered:
            regions = classes[cls]
            role_bytes: dict[str, int] = {}
            for r in regions:
                role_bytes[r.role] = role_bytes.get(r.role, 0) + r.size
            plans.append(
                PagePlan(
                    group=group.index,
                    shard_class=cls,
                    regions=tuple(regions),
                    page_size=sum(r.size for r in regions),
                    fingerprint=_fingerprint(layout, cls, regions),
                    role_bytes=tuple(role_bytes.items()),
                )
            )
    return tuple(plans)


@dataclass(frozen=True)
class RankShare:
    """A rank's relation to one page kind: which shard it holds, among how many copies."""

    plan: PagePlan
    shard_index: int
    replica_index: int
    dup: int


def rank_shares(layout: KvLayout, plans: Sequence[PagePlan], rank: int) -> tuple[RankShare, ...]:
    """Per page kind, the shard this rank loads and its replica position for writing."""
    shares = []
    for plan in plans:
        units = 1 if plan.shard_class.replicated else layout.role(plan.regions[0].role).units
        pos = shard_position(rank, layout.tp_size, units)
        shares.append(RankShare(plan, pos.shard_index, pos.replica_index, pos.dup))
    return tuple(shares)


def writer_replica(block_hash: bytes, dup: int, policy: WriterPolicy) -> int:
    """The replica index that writes a page of this block.

    The block hash is already a uniform cryptographic digest, so its low bits spread
    blocks evenly over replicas without another hash.
    """
    if dup == 1 or policy is WriterPolicy.FIRST:
        return 0
    return int.from_bytes(block_hash[:8], "little") % dup


def lookup_keys(
    prefix: str, plans: Sequence[PagePlan], block_hashes: Sequence[bytes]
) -> list[list[str]]:
    """For each block, the keys of every page *any* rank will load: all shards, all groups."""
    per_block: list[list[str]] = []
    for h in block_hashes:
        keys: list[str] = []
        for plan in plans:
            for j in range(plan.shard_class.shard_count):
                keys.append(
                    page_key(prefix, plan.shard_class.component(j), plan.group, plan.fingerprint, h)
                )
        per_block.append(keys)
    return per_block


def count_prefix_hit(per_block_present: Sequence[Sequence[bool]]) -> int:
    """Length of the longest prefix of blocks whose every page is present (rule 3)."""
    hit = 0
    for present in per_block_present:
        if not all(present):
            break
        hit += 1
    return hit


def share_key(prefix: str, share: RankShare, block_hash: bytes) -> str:
    plan = share.plan
    return page_key(
        prefix,
        plan.shard_class.component(share.shard_index),
        plan.group,
        plan.fingerprint,
        block_hash,
    )
