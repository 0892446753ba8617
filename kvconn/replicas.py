"""Pages several ranks hold: which they are, which samples of them are compared, how the
comparison is judged, and the per-rank keys a page kind falls back to.

Storing a page once for the ``dup`` ranks that hold it (the replicated class: an MLA
latent, an index-K; a GQA head on consecutive ranks) is right only if those ranks really
hold the same bytes. If they do not (a layout that declares the wrong number of KV
heads, an engine whose "replicated" projection differs by rank, a faulty device), the
one stored copy is some other rank's bytes for every rank but its writer: wrong bytes,
served silently. So a connector over a TP group compares, now and then, what the
holders of the same page hold (:mod:`kvconn.replica_check` runs the comparison), and a
page kind whose holders disagree *falls back to per-rank keys*: from then on each rank
stores and loads its own copy, as if each of the kind's roles had one unit per rank.

This module is the pure part, torch-free, so that a scheduler's lookup
(:mod:`kvconn.lookup`) keys fallen-back kinds as the ranks do:

* :func:`shared_kinds` — the page kinds with ``dup > 1``, and the byte ranges of each
  role inside their pages (a disagreement is reported by role);
* :func:`sampled` — which saved blocks are compared: a function of the block hash, so
  every rank picks the same blocks without talking;
* :func:`judge` — the verdict from every rank's digests, the same on every rank;
* :func:`per_rank_plan` — a kind keyed per rank: ``w<tp>r<rank>``, and the fingerprint
  of the same regions with every role at ``units = tp``, the key any layout declaring
  those roles per rank computes (a page is keyed by what it holds, as always);
* the **marker** (:func:`kvconn.keys.per_rank_key`): a small key next to the pages that
  says "this kind is kept per rank". Ranks put it when they fall back; lookups check it,
  so a scheduler in another process keys the kind per rank too (:class:`~kvconn.lookup.
  Lookup`), and ranks of other instances adopt it at their next check.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from kvconn.plan import PagePlan, RankShare, ShardClass

__all__ = [
    "ABSENT",
    "BLOCKS_PER_CHECK",
    "Disagreement",
    "Judgement",
    "RoleSpans",
    "SharedKind",
    "judge",
    "marker_value",
    "per_rank_plan",
    "per_rank_share",
    "sampled",
    "shared_kinds",
]

#: A digest slot with nothing in it: the block has no slot in that kind's layer group
#: (``NO_SLOT``), the kind already keys per rank, or the rank could not read its bytes.
#: Digests are xxh3-64 cut to 63 bits, so no digest is negative.
ABSENT = -1
DIGEST_MASK = (1 << 63) - 1
#: Blocks one comparison covers. Its message has a fixed size (this many blocks, padded
#: with :data:`ABSENT`), so ranks that disagree on a save's blocks still meet in the same
#: collective and find out from its header instead of exchanging mismatched sizes.
BLOCKS_PER_CHECK = 8


def sampled(block_hash: bytes, every: int) -> bool:
    """Whether a saved block is compared across its holders: 1 block in ``every``.

    Read from bytes 8-16 of the block hash, a uniform digest: every rank decides alike
    without talking, and the choice is independent of the writer and reader rules,
    which use bytes 0-8 (samples fall on every replica's writes).
    """
    return every > 0 and int.from_bytes(block_hash[8:16], "little") % every == 0


@dataclass(frozen=True)
class RoleSpans:
    """Where one role's bytes lie in a page: ``(start, end)`` ranges, in page order."""

    role: str
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SharedKind:
    """A page kind whose every page ``dup`` consecutive ranks hold, identically if the
    layout is right; compared role by role."""

    index: int  # the kind's position among the layout's plans
    plan: PagePlan  # as planned: one key per shard, shared by its holders
    dup: int
    roles: tuple[RoleSpans, ...]

    @property
    def shards(self) -> int:
        return self.plan.shard_class.shard_count

    def holders(self, shard: int) -> range:
        """The TP ranks that hold shard ``shard`` of this kind."""
        return range(shard * self.dup, (shard + 1) * self.dup)


def shared_kinds(tp_size: int, plans: Sequence[PagePlan]) -> tuple[SharedKind, ...]:
    """The page kinds of ``plans`` that more than one rank holds (``dup > 1``)."""
    kinds = []
    for index, plan in enumerate(plans):
        dup = tp_size // plan.shard_class.shard_count
        if dup <= 1:
            continue
        spans: dict[str, list[tuple[int, int]]] = {}
        offset = 0
        for region in plan.regions:
            spans.setdefault(region.role, []).append((offset, offset + region.size))
            offset += region.size
        roles = tuple(RoleSpans(role, tuple(s)) for role, s in spans.items())
        kinds.append(SharedKind(index, plan, dup, roles))
    return tuple(kinds)


def items_per_block(kinds: Sequence[SharedKind]) -> int:
    """Digests one rank contributes per compared block: one per role of each kind."""
    return sum(len(kind.roles) for kind in kinds)


def per_rank_plan(plan: PagePlan, tp_size: int) -> PagePlan:
    """``plan`` keyed per rank: class ``w<tp>``, each role at ``units = tp``.

    The regions, sizes and checksum stay, so staging and movement do not change; the key
    and fingerprint do, so per-rank pages never meet the shared ones. The fingerprint is
    the one a layout declaring these roles with one unit per rank gives the same regions:
    a page is keyed by what it holds, whoever decided to key it per rank.
    """
    manifest = replace(
        plan.manifest,
        shard_class=f"w{tp_size}",
        roles=tuple((name, tp_size, dtype) for name, _, dtype in plan.manifest.roles),
    )
    return replace(
        plan,
        shard_class=ShardClass(tp_size),
        fingerprint=manifest.fingerprint,
        manifest=manifest,
    )


def per_rank_share(plan: PagePlan, rank: int) -> RankShare:
    """A rank's share of a per-rank kind: its own page, which only it holds and writes."""
    return RankShare(plan, shard_index=rank, replica_index=0, dup=1)


@dataclass(frozen=True)
class Disagreement:
    """The holders of one page did not hold the same bytes of one role."""

    block: int  # index among the compared blocks
    kind: SharedKind
    role: str
    shard: int
    #: Ranks whose bytes differ from the most common bytes; every holder that was
    #: compared when no bytes are the most common (a pair that differs: both).
    odd: tuple[int, ...]
    agreeing: tuple[int, ...]  # the holders of the most common bytes (empty on a tie)


@dataclass(frozen=True)
class Judgement:
    """What a comparison found, the same on every rank (every rank judges one table)."""

    verified: int  # pages (block, kind, shard) whose holders all held the same bytes
    disagreements: tuple[Disagreement, ...]

    @property
    def mismatched(self) -> int:
        """Pages (block, kind, shard) whose holders held different bytes."""
        return len({(d.block, d.kind.index, d.shard) for d in self.disagreements})

    def kinds_to_split(self, kinds: Sequence[SharedKind], done: Collection[int]) -> set[int]:
        """Kinds that fall back: every kind, in any layer group, holding a role whose
        holders disagreed, unless it keys per rank already (``done``).

        By role, because what a disagreement shows is that a role is not the same on
        its holders (its units are wrong, or the engine does not replicate it), which
        holds in every layer group; by kind, because a page is keyed as a whole.
        """
        roles = {d.role for d in self.disagreements}
        return {
            k.index for k in kinds if k.index not in done and any(r.role in roles for r in k.roles)
        }


def judge(
    digests: Sequence[Sequence[int]],
    kinds: Sequence[SharedKind],
    blocks: int,
    skip: Collection[int] = (),
) -> Judgement:
    """Compare the holders of every page of the first ``blocks`` compared blocks.

    ``digests[rank]`` is that rank's list: for each block, for each kind in order, one
    digest per role (:data:`ABSENT` where it has none). Kinds in ``skip`` (keyed per
    rank already) are not compared. A role that fewer than two holders digested is not
    compared either; a page counts as verified when every role of it was compared and
    agreed.
    """
    items = items_per_block(kinds)
    verified = 0
    found: list[Disagreement] = []
    for b in range(blocks):
        offset = b * items
        for kind in kinds:
            first = offset
            offset += len(kind.roles)
            if kind.index in skip:
                continue
            for shard in range(kind.shards):
                compared = agreed = True
                for j, role in enumerate(kind.roles):
                    held = {
                        rank: digests[rank][first + j]
                        for rank in kind.holders(shard)
                        if digests[rank][first + j] != ABSENT
                    }
                    if len(held) < 2:
                        compared = False
                        continue
                    if len(set(held.values())) > 1:
                        agreed = False
                        found.append(_disagreement(b, kind, role.role, shard, held))
                if compared and agreed:
                    verified += 1
    return Judgement(verified, tuple(found))


def _disagreement(
    block: int, kind: SharedKind, role: str, shard: int, held: dict[int, int]
) -> Disagreement:
    counts = Counter(held.values()).most_common()
    top, count = counts[0]
    if count > 1 and (len(counts) == 1 or counts[1][1] < count):
        odd = tuple(r for r, d in held.items() if d != top)
        agreeing = tuple(r for r, d in held.items() if d == top)
    else:  # no bytes are the most common: every compared holder is named
        odd, agreeing = tuple(held), ()
    return Disagreement(block, kind, role, shard, odd, agreeing)


def marker_value(kind: SharedKind, tp_size: int, found: Sequence[Disagreement]) -> bytes:
    """What a marker holds, for people and tools (only its existence is ever read): the
    kind, its per-rank fingerprint, and what was found to differ."""
    held = {r.role for r in kind.roles}
    mine = [d for d in found if d.role in held]
    doc = {
        "version": 1,
        "page_kind": kind.plan.label,
        "per_rank_fingerprint": per_rank_plan(kind.plan, tp_size).fingerprint,
        "roles": sorted({d.role for d in mine}),
        "ranks": sorted({r for d in mine for r in d.odd}),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
