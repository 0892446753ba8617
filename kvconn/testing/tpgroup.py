"""A real TP group in processes: N ranks over one store, verifying every loaded byte.

Shipped in the package so that every backend — ours and third-party ones — proves the
group-level rules (ranks agree on hits; loads return exactly what the writer saved) on
its real store, not only the per-call contract.

With ``stripe=True`` the ranks also form a gloo process group and hand it to their
connectors, so loads read each shared page once per group (:mod:`kvconn.striped_load`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.layout import KvLayout, shard_position
from kvconn.testing.processes import rank_context, start


def expected_bytes(block_hash: bytes, layer: int, role: str, shard: int, size: int) -> torch.Tensor:
    """What "recomputing" a region of a block gives: a function of content and shard only."""
    seed = hashlib.blake2b(block_hash + f"/{layer}/{role}/{shard}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed, "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def compute_block(
    layout: KvLayout, rank: int, pools: Sequence[torch.Tensor], block_hash: bytes, slot: int
) -> None:
    for group in layout.groups:
        for region in group.regions:
            shard = shard_position(rank, layout.tp_size, layout.role(region.role).units).shard_index
            start = region.base + slot * region.stride
            pools[region.pool][start : start + region.size] = expected_bytes(
                block_hash, region.layer, region.role, shard, region.size
            )


def verify_block(
    layout: KvLayout, rank: int, pools: Sequence[torch.Tensor], block_hash: bytes, slot: int
) -> int:
    """Number of regions whose bytes differ from recomputation (0 when all match)."""
    bad = 0
    for group in layout.groups:
        for region in group.regions:
            shard = shard_position(rank, layout.tp_size, layout.role(region.role).units).shard_index
            start = region.base + slot * region.stride
            got = pools[region.pool][start : start + region.size]
            want = expected_bytes(block_hash, region.layer, region.role, shard, region.size)
            bad += int(not torch.equal(got, want))
    return bad


@dataclass
class RankReport:
    rank: int
    hits: list[int] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)
    mismatched_regions: int = 0
    verified_blocks: int = 0
    #: per request, the blocks the load reported failed
    failed: list[tuple[int, ...]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


#: Called on every rank after the group's lookup and before the load, with (rank,
#: connector, request index, block hashes, hit); the ranks meet at a barrier after it.
#: Must be picklable (a module-level function or a dataclass instance).
BetweenLookupAndLoad = Callable[[int, Connector, int, list[bytes], int], None]


@dataclass(frozen=True)
class DamagePage:
    """A fault between a lookup and its load: rank 0 evicts (deletes) or corrupts one
    stored page of one block of one request, after the group found it.

    ``component`` is the page's shard segment (``replicated``, ``w8r3``); a corrupted
    page keeps its size, so only its checksum can tell.
    """

    request: int
    block: int
    component: str
    corrupt: bool = False

    def __call__(
        self, rank: int, conn: Connector, request: int, hashes: list[bytes], hit: int
    ) -> None:
        if rank != 0 or request != self.request or hit <= self.block:
            return
        keys = [k for k in conn.keys.block_keys(hashes[self.block]) if f"/{self.component}/" in k]
        assert len(keys) == 1, keys
        assert conn.backend.delete(keys) == [True], f"could not delete {keys[0]}"
        if self.corrupt:
            plan = next(p for p in conn.plans if f"/{p.fingerprint}/" in keys[0])
            garbage = bytes(range(256)) * (-(-plan.value_size // 256))
            assert conn.backend.put(keys, [memoryview(garbage[: plan.value_size])]) == [True]


def gloo_group(rank: int, world: int, rendezvous: str) -> Any:
    """Join a gloo world of ``world`` processes through the file ``rendezvous`` and
    return a group of all of them for kvconn (its own, as an engine should give it)."""
    import datetime

    import torch.distributed as dist

    # a rank that died leaves the others in a collective this long, not gloo's 30 min
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timeout
    )
    return dist.new_group(list(range(world)), timeout=timeout)


def _rank_main(
    rank: int,
    layout_factory: Callable[[], KvLayout],
    config: dict[str, Any],
    requests: list[list[int]],
    barrier: Any,
    queue: Any,
    rendezvous: str | None = None,
    between: BetweenLookupAndLoad | None = None,
) -> None:
    report = RankReport(rank)
    try:
        layout = layout_factory()
        pools = [torch.zeros(size, dtype=torch.uint8) for size in layout.pool_sizes]
        group = None if rendezvous is None else gloo_group(rank, layout.tp_size, rendezvous)
        if group is not None:  # a group is for striped loads here, unless the config says
            config = {"stripe_reads": True, **config}
        conn = Connector(
            ConnectorConfig.from_dict(config), layout, rank=rank, pools=pools, group=group
        )
        num_slots = layout.groups[0].num_slots
        for tokens in requests:
            hashes = block_hashes(tokens, layout.tokens_per_block)[:num_slots]
            slots = list(range(len(hashes)))
            barrier.wait()  # nobody writes while the group looks up
            hit = conn.lookup(hashes).blocks
            report.hits.append(hit)
            if between is not None:
                barrier.wait()  # every rank has its hit before the fault
                between(rank, conn, len(report.hits) - 1, hashes, hit)
            barrier.wait()
            result = conn.load(hashes[:hit], slots[:hit])
            report.loaded.append(result.loaded)
            report.failed.append(result.failed)
            for i in range(result.loaded):
                report.mismatched_regions += verify_block(layout, rank, pools, hashes[i], slots[i])
                report.verified_blocks += 1
            for i in range(result.loaded, len(hashes)):
                compute_block(layout, rank, pools, hashes[i], slots[i])
            conn.save(hashes, slots)
            barrier.wait()  # every rank's pages are stored before the next lookup
        report.stats = conn.stats.snapshot()
        conn.close()
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    except BaseException as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    queue.put(report)


def overlapping_requests(count: int, tokens_per_block: int, seed: int = 0) -> list[list[int]]:
    """Requests that share system prompts and extend earlier turns, so prefixes repeat."""
    g = torch.Generator().manual_seed(seed)
    systems = [
        torch.randint(0, 50_000, (tokens_per_block * 3,), generator=g).tolist() for _ in range(2)
    ]
    requests: list[list[int]] = []
    history: list[list[int]] = []
    for i in range(count):
        # every third request is the next turn of the previous conversation
        base = history[-1] if history and i % 3 == 2 else systems[i % 2]
        turn = torch.randint(0, 50_000, (tokens_per_block * (1 + i % 3) + 5,), generator=g).tolist()
        tokens = base + turn
        history.append(tokens)
        requests.append(tokens)
    return requests


def run_tp_group(
    layout_factory: Callable[[], KvLayout],
    config: dict[str, Any],
    requests: list[list[int]],
    *,
    timeout_s: float = 240,
    stripe: bool = False,
    between: BetweenLookupAndLoad | None = None,
) -> list[RankReport]:
    """Run every rank as a process over ``requests``; reports ordered by rank.

    ``stripe``: the ranks form a gloo group and stripe their loads over it.
    ``between``: a fault to inject between each lookup and its load.
    """
    tp = layout_factory().tp_size
    ctx = rank_context()
    barrier = ctx.Barrier(tp, timeout=timeout_s)
    queue = ctx.Queue()
    procs = []
    reports = []
    workdir = tempfile.mkdtemp(prefix="kvconn-tpgroup-")
    rendezvous = os.path.join(workdir, "rendezvous") if stripe else None
    try:
        for r in range(tp):
            args = (r, layout_factory, config, requests, barrier, queue, rendezvous, between)
            procs.append(start(ctx, _rank_main, args))
        for _ in procs:
            reports.append(queue.get(timeout=timeout_s))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return sorted(reports, key=lambda r: r.rank)


def assert_group_consistent(reports: list[RankReport], *, exact_loads: bool = True) -> None:
    """The group-level rules every store must keep, whatever it evicted.

    Every rank ran without error and saw the same hit count for every request; no
    loaded byte differed from recomputation; no rank loaded more than the hit. With
    ``exact_loads`` (no eviction in play) every rank loaded exactly the hit.
    """
    assert [r.error for r in reports] == [None] * len(reports), [r.error for r in reports]
    assert all(r.hits == reports[0].hits for r in reports), [r.hits for r in reports]
    assert sum(r.mismatched_regions for r in reports) == 0
    for r in reports:
        assert all(loaded <= hit for loaded, hit in zip(r.loaded, r.hits))
        if exact_loads:
            assert r.loaded == r.hits, (r.rank, r.loaded, r.hits)
