"""One connector called from several threads at once, as SGLang calls exists/get/set.

Real threads, against the LMDB backend and against fakes that detect what must not
happen (a backend that is not thread-safe entered twice at once) or prove what must
(a thread-safe backend is not serialized, and concurrent loads keep their own staging).
"""

import threading
from collections.abc import Callable

import torch

from kvconn.backend import Capabilities
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.layout import KvLayout
from kvconn.tools.models import minimax_m3
from tests.fakes import DictBackend
from tests.helpers import fill_pool, slot_bytes

BLOCKS = 8
ROUNDS = 6


def layout() -> KvLayout:
    return minimax_m3(tp_size=1, layers=2, num_slots=2 * BLOCKS)


def hashes(salt: str) -> list[bytes]:
    return block_hashes(list(range(32 * BLOCKS)), 32, ReuseScope(cache_salt=salt))


def filled_pools(fill: bool = True) -> list[torch.Tensor]:
    lay = layout()
    pools = [torch.zeros(size, dtype=torch.uint8) for size in lay.pool_sizes]
    if fill:
        fill_pool(lay, 0, pools)
    return pools


def connector(backend, *, fill: bool = True, **config) -> Connector:
    settings = {"model": "threads", "backend": "dict", "retry_interval_s": 0, **config}
    return Connector(
        ConnectorConfig(**settings), layout(), pools=filled_pools(fill), backend=backend
    )


def run_threads(*targets: Callable[[], None]) -> None:
    """Start every target at once; re-raise the first failure of any thread."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def engine_threads(conn: Connector, stored: list[bytes]) -> list[Callable[[], None]]:
    """SGLang's three threads on one connector: exists, get (load) and set (save).

    ``stored`` is already in the store (saved from slots 0..BLOCKS-1 of an identical
    pool); the get thread loads it into slots BLOCKS.. and checks every byte each round.
    """
    lay = conn.layout
    source = [slot_bytes(lay, conn.pools, s) for s in range(BLOCKS)]
    targets = list(range(BLOCKS, 2 * BLOCKS))

    def exists() -> None:
        for _ in range(ROUNDS * 4):
            assert conn.lookup(stored).blocks == BLOCKS

    def get() -> None:
        for _ in range(ROUNDS):
            for pool in conn.pools:
                for region in lay.groups[0].regions:  # clear the target slots
                    for s in targets:
                        start = region.base + s * region.stride
                        pool[start : start + region.size] = 0
            assert conn.load(stored, targets).loaded == BLOCKS
            for i, s in enumerate(targets):
                assert slot_bytes(lay, conn.pools, s) == source[i]

    def set_() -> None:
        for r in range(ROUNDS):
            assert conn.save(hashes(f"new-{r}"), list(range(BLOCKS))).dropped == 0

    return [exists, get, set_]


def test_exists_get_and_set_threads_share_one_connector_over_lmdb(tmp_path):
    config = ConnectorConfig(model="threads", backend="lmdb", options={"path": str(tmp_path)})
    stored = hashes("stored")
    with Connector(config, layout(), pools=filled_pools()) as writer:
        writer.save(stored, list(range(BLOCKS)))
    conn = Connector(config, layout(), pools=filled_pools())
    run_threads(*engine_threads(conn, stored))
    assert conn.stats.lookups == ROUNDS * 4
    for r in range(ROUNDS):  # every page of every new round arrived
        assert conn.lookup(hashes(f"new-{r}")).blocks == BLOCKS
    conn.close()


class ExclusiveStore(DictBackend):
    """Not thread-safe, and says so: fails the test if two calls are ever inside it."""

    def __init__(self) -> None:
        super().__init__()
        self._inside = threading.Lock()
        self.overlaps = 0

    def _guard(self, op: str, n: int) -> None:
        # Every call passes here first; hold the store for a moment, as a real call would.
        if not self._inside.acquire(blocking=False):
            self.overlaps += 1
            self._inside.acquire()
        try:
            threading.Event().wait(0.001)  # widen the window another thread could enter in
            super()._guard(op, n)
        finally:
            self._inside.release()


def test_a_backend_that_is_not_thread_safe_is_never_entered_by_two_threads():
    store = ExclusiveStore()
    stored = hashes("stored")
    connector(store).save(stored, list(range(BLOCKS)))
    conn = connector(store)
    other = connector(store)  # a second connector over the same backend object

    def other_lookups() -> None:
        for _ in range(ROUNDS * 4):
            other.lookup(stored)

    run_threads(*engine_threads(conn, stored), other_lookups)
    assert store.overlaps == 0


class MeetingStore(DictBackend):
    """Thread-safe: each get waits until another thread's get is inside too."""

    capabilities = Capabilities(delete=True, thread_safe=True)

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.meet = threading.Barrier(parties, timeout=10)

    def _get(self, keys, buffers, *, scratch):
        out = super()._get(keys, buffers, scratch=scratch)
        self.meet.wait()
        return out


def test_a_thread_safe_backend_is_called_concurrently_and_each_load_keeps_its_staging():
    store = MeetingStore(parties=2)
    conn = connector(store)
    first, second = hashes("a"), hashes("b")
    # Different bytes under each request's keys: slots 0..7 and the same slots of a
    # pool filled with another seed.
    conn.save(first, list(range(BLOCKS)))
    other = connector(store, fill=False)
    fill_pool(other.layout, 0, other.pools, salt=1)
    other.save(second, list(range(BLOCKS)))
    readers = [connector(store, fill=False) for _ in range(2)]
    shared = readers[0]  # both loads go through one connector at the same time

    def load(hs: list[bytes], slots: list[int]) -> Callable[[], None]:
        def run() -> None:
            assert shared.load(hs, slots).loaded == BLOCKS

        return run

    run_threads(load(first, list(range(BLOCKS))), load(second, list(range(BLOCKS, 2 * BLOCKS))))
    lay = conn.layout
    for i in range(BLOCKS):
        assert slot_bytes(lay, shared.pools, i) == slot_bytes(lay, conn.pools, i)
        assert slot_bytes(lay, shared.pools, BLOCKS + i) == slot_bytes(lay, other.pools, i)
    assert shared._staging.buffers == 2  # one per load in flight, not one per call


def test_concurrent_failures_back_off_once_and_count_every_error():
    store = DictBackend()
    conn = connector(store, retry_interval_s=60)
    store.down = True
    results = []
    run_threads(*[lambda: results.append(conn.lookup(hashes("x"))) for _ in range(4)])
    assert all(not r.available and r.blocks == 0 for r in results)
    assert conn.stats.lookup_errors == 4
    assert 1 <= conn.stats.backend_errors <= 4  # callers already inside may fail too
    assert store.ops("exists") == conn.stats.backend_errors  # then the rest back off
