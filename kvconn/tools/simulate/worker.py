"""One TP rank of the simulation: its own process, KV pool, connector and backend handle.

The rank behaves as an engine worker does around a prefill: it loads the blocks the
group-wide lookup found into its pool slots, checks every loaded page against what
recomputation would give, "computes" the remaining blocks into their slots and saves
the pages it is the designated writer of. The coordinator tells it, between the load
and the compute, how many blocks the *whole group* loaded (the minimum over ranks), so
that a page that failed on one rank makes every rank recompute that block.
"""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.layout import KvLayout, Region
from kvconn.plan import RankShare, share_key
from kvconn.registry import load_backend
from kvconn.tools.models import Preset
from kvconn.tools.simulate.synth import Synth
from kvconn.tools.simulate.timing import TimedBackend, timed

T = TypeVar("T")

PARTS = ("store", "movement", "planning", "compute", "verify")
#: A rank that died leaves the others in a collective this long, not gloo's 30 minutes.
GROUP_TIMEOUT_S = 300


class _Clock:
    """Wall-clock and thread CPU time since construction."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def add_to(self, wall: dict[str, float], cpu: dict[str, float], part: str) -> None:
        wall[part] += time.perf_counter() - self.wall
        cpu[part] += time.thread_time() - self.cpu


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs; small and picklable, rebuilt in the child."""

    rank: int
    preset: Preset
    tp_size: int
    layers: int
    num_slots: int
    tokens_per_block: int
    config: ConnectorConfig
    max_examples: int = 5
    #: The file through which the ranks form a gloo group for striped loads (None: every
    #: rank reads every page it loads itself).
    rendezvous: str | None = None
    #: Roles this rank computes differently from its replicas (an injected mismatch).
    diverged: frozenset[str] = frozenset()

    def layout(self) -> KvLayout:
        return self.preset.layout(self.tp_size, self.layers, self.num_slots, self.tokens_per_block)


class RankWorker:
    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.layout = spec.layout()
        self.pools = [torch.zeros(size, dtype=torch.uint8) for size in self.layout.pool_sizes]
        self.backend: TimedBackend = timed(load_backend(spec.config.backend, spec.config.options))
        self.group = _join_group(spec) if spec.rendezvous is not None else None
        self.connector = Connector(
            spec.config,
            self.layout,
            rank=spec.rank,
            pools=self.pools,
            backend=self.backend,
            group=self.group,
        )
        self.synth = Synth(
            self.layout, spec.rank, spec.config.model, spec.config.shard_heads, spec.diverged
        )
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        for group in self.layout.groups:
            for r in group.regions:
                self._views[(r.layer, r.role)] = _word_view(self.pools[r.pool], r)
        # Wall-clock and CPU seconds per part. With more ranks than cores, wall time
        # includes waiting for a core; CPU time shows where the work itself goes.
        self.times = dict.fromkeys(PARTS, 0.0)
        self.cpu = dict.fromkeys(PARTS, 0.0)
        self.verified = 0
        self.errors = 0
        self.examples: list[str] = []
        self._request = -1
        self._hashes: list[bytes] = []
        self._slots = torch.empty(0, dtype=torch.long)

    def view(self, region: Region) -> torch.Tensor:
        """``[num_slots, words]`` view of the region in this rank's pool (see _word_view)."""
        return self._views[(region.layer, region.role)]

    # ------------------------------------------------------------------ steps
    def load(self, request: int, hashes: list[bytes], hit: int, slots: list[int]) -> int:
        """Load the group's hit prefix; return how many leading blocks arrived whole."""
        self._request = request
        self._hashes = hashes
        self._slots = torch.tensor(slots, dtype=torch.long)
        if hit == 0:
            return 0
        result = self._connector_call(lambda: self.connector.load(hashes[:hit], self._slots[:hit]))
        if result.loaded:
            self.verify(result.loaded)
        return result.loaded

    def compute_and_save(self, agreed: int) -> None:
        """Recompute blocks ``agreed..`` into their slots and save this rank's pages."""
        hashes, slots = self._hashes[agreed:], self._slots[agreed:]
        if not hashes:
            return
        clock = _Clock()
        for group in self.layout.groups:
            for region in group.regions:
                view = self.view(region)
                data = self.synth.region_bytes(hashes, region).view(view.dtype)
                view.index_copy_(0, slots, data)
        clock.add_to(self.times, self.cpu, "compute")
        self._connector_call(lambda: self.connector.save(hashes, slots))

    def verify(self, n: int) -> None:
        """Compare every page of blocks ``0..n`` with recomputation, byte for byte.

        A page kind this rank holds several pages of per block (``shard_heads``) is
        checked over its whole regions once, and counts as that many pages.
        """
        clock = _Clock()
        hashes, slots = self._hashes[:n], self._slots[:n]
        for share in self.connector.shares:
            if share.part:
                continue  # the kind's first share checks its whole regions
            bad = torch.zeros(n, dtype=torch.bool)
            for region in share.plan.regions:
                view = self.view(region)
                got = view.index_select(0, slots)
                expected = self.synth.region_bytes(hashes, region).view(view.dtype)
                rows = (got != expected).any(dim=1)
                if bool(rows.any()):
                    self._note(share, region, rows, got, expected)
                bad |= rows
            self.verified += n * share.plan.parts
            self.errors += int(bad.sum()) * share.plan.parts
        clock.add_to(self.times, self.cpu, "verify")

    def _note(
        self,
        share: RankShare,
        region: Region,
        rows: torch.Tensor,
        got: torch.Tensor,
        expected: torch.Tensor,
    ) -> None:
        for b in rows.nonzero().flatten().tolist():
            if len(self.examples) >= self.spec.max_examples:
                return
            diff = got[b].view(torch.uint8) != expected[b].view(torch.uint8)
            offset = int(diff.nonzero()[0])
            key = share_key(self.connector.prefix, share, self._hashes[b])
            self.examples.append(
                f"request {self._request} block {b}, rank {self.spec.rank}, page "
                f"{share.plan.label} ({key}): {region.role}@layer{region.layer} differs "
                f"from recomputation at byte {offset} of {region.size}"
            )

    def _connector_call(self, fn: Callable[[], T]) -> T:
        """Run a connector call, splitting its time into store, planning and movement.

        Planning is what the connector does before its first store call (owners, keys);
        store is the time inside the backend; movement is the rest (gather/scatter and
        staging copies).
        """
        backend = self.backend
        backend.mark()
        store_wall, store_cpu = backend.seconds, backend.cpu_seconds
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = fn()
        end, end_cpu = time.perf_counter(), time.thread_time()
        first = backend.first_call or (end, end_cpu)
        for table, total, store, planning in (
            (self.times, end - start, backend.seconds - store_wall, first[0] - start),
            (self.cpu, end_cpu - start_cpu, backend.cpu_seconds - store_cpu, first[1] - start_cpu),
        ):
            table["store"] += store
            table["planning"] += planning
            table["movement"] += max(0.0, total - store - planning)
        return result

    def result(self) -> dict[str, Any]:
        return {
            "rank": self.spec.rank,
            "stats": self.connector.stats.snapshot(),
            "verified": self.verified,
            "errors": self.errors,
            "examples": self.examples,
            "time": dict(self.times),
            "cpu": dict(self.cpu),
        }

    def close(self) -> None:
        self.connector.close()
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _join_group(spec: RankSpec) -> Any:
    """The TP group as an engine would hand it over: gloo, the ranks in TP order."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{spec.rendezvous}",
        rank=spec.rank,
        world_size=spec.tp_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    return dist.new_group(
        list(range(spec.tp_size)), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    )


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word_view(pool: torch.Tensor, region: Region) -> torch.Tensor:
    """The region as ``[num_slots, size / w]`` words of the widest width ``w`` that tiles it.

    Comparing and indexing 8-byte words instead of bytes makes verification several
    times cheaper; verification must not dominate a run that is about the store.
    """
    for width, dtype in _WORDS:
        if region.base % width == 0 and region.size % width == 0 and region.stride % width == 0:
            words = pool[: pool.numel() // width * width].view(dtype)
            return torch.as_strided(
                words,
                (region.num_slots, region.size // width),
                (region.stride // width, 1),
                region.base // width,
            )
    raise AssertionError("width 1 always tiles")


def rank_main(conn: Connection, spec: RankSpec) -> None:
    """Process entry point: build the rank, then serve the coordinator's steps."""
    torch.set_num_threads(1)  # TP ranks share the machine's cores, as GPUs would not
    try:
        worker = RankWorker(spec)
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", None))
    try:
        while True:
            op, payload = conn.recv()
            if op == "load":
                request, hashes, hit, slots = payload
                conn.send(("loaded", worker.load(request, hashes, hit, slots)))
            elif op == "compute":
                worker.compute_and_save(payload)
                conn.send(("saved", None))
            elif op == "finish":
                result = worker.result()
                worker.close()
                conn.send(("result", result))
                return
            else:
                raise RuntimeError(f"unknown step {op!r}")
    except EOFError:
        return  # the coordinator went away; nothing to report to
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
    finally:
        conn.close()
