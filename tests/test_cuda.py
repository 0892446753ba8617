"""The CUDA path: pools on the GPU, pages staged through pinned host memory.

Runs only where a GPU is present (never in CI here); the same rules as on the CPU.
"""

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.plan import WriterPolicy
from kvconn.tools.models import minimax_m3
from tests.fakes import DictBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pages_saved_from_a_gpu_pool_load_back_byte_for_byte_into_another():
    layout = minimax_m3(tp_size=8, layers=3, num_slots=32)
    store = DictBackend()
    config = ConnectorConfig(model="m", backend="dict")
    src = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8, device="cuda")
    hashes = block_hashes(list(range(32 * 10)), 32)
    slots = list(range(5, 15))
    for rank in range(8):
        Connector(config, layout, rank=rank, pools=[src], backend=store).save(hashes, slots)
    dst = torch.zeros_like(src)
    reader = Connector(config, layout, rank=3, pools=[dst], backend=store)
    with reader._staging.borrow() as staging:
        assert staging.take(1)[0].is_pinned()
    assert reader.load(hashes, slots).loaded == 10
    for region in layout.groups[0].regions:
        for s in slots:
            a = region.base + s * region.stride
            assert torch.equal(dst[a : a + region.size], src[a : a + region.size])


@pytest.mark.parametrize("checksum", ["xxh3-64", "none"])
def test_a_gpu_pool_round_trips_with_either_checksum_and_never_receives_a_bad_page(checksum):
    layout = minimax_m3(tp_size=2, layers=2, num_slots=16)
    store = DictBackend()
    config = ConnectorConfig(
        model="m", backend="dict", checksum=checksum, writer_policy=WriterPolicy.ALL
    )
    src = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8, device="cuda")
    hashes = block_hashes(list(range(32 * 4)), 32)
    writer = Connector(config, layout, rank=0, pools=[src], backend=store)
    assert writer.save(hashes, [0, 1, 2, 3]).written == 8
    key = next(k for k in store.data if "/w2r0/" in k and k.endswith(hashes[2].hex()))
    garbled = bytearray(store.data[key])
    garbled[:64] = bytes(64)
    store.data[key] = bytes(garbled)
    dst = torch.zeros_like(src)
    reader = Connector(config, layout, rank=0, pools=[dst], backend=store)
    loaded = reader.load(hashes, [4, 5, 6, 7]).loaded
    assert loaded == (2 if checksum == "xxh3-64" else 4)
    for region in layout.groups[0].regions:
        for block in range(loaded):
            a, b = region.base + block * region.stride, region.base + (block + 4) * region.stride
            if checksum == "none" and block == 2 and region.role != "index_k":
                continue  # without a checksum the garbled page was loaded: nothing catches it
            assert torch.equal(dst[b : b + region.size], src[a : a + region.size])


def _striped_into_gpu_pools(rank, path, rendezvous, results):
    """One rank of two: GPU pools, a gloo group (pages exchanged in host staging)."""
    import traceback

    from kvconn.testing.tpgroup import compute_block, gloo_group, verify_block
    from kvconn.tools.models import get_preset

    try:
        layout = get_preset("deepseek-v3.2").layout(2, 2, 16, 32)  # every byte replicated
        group = gloo_group(rank, 2, rendezvous)
        host = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]
        hashes = block_hashes(list(range(32 * 4)), 32)
        for slot, h in enumerate(hashes):
            compute_block(layout, rank, host, h, slot)
        pools = [p.cuda() for p in host]
        config = {"model": "m", "backend": "lmdb", "options": {"path": path}, "stripe_reads": True}
        conn = Connector(config, layout, rank=rank, pools=pools, group=group)
        assert conn.save(hashes, [0, 1, 2, 3]).ok
        torch.distributed.barrier()
        result = conn.load(hashes, [8, 9, 10, 11])
        back = [p.cpu() for p in pools]
        bad = sum(verify_block(layout, rank, back, h, s) for h, s in zip(hashes, [8, 9, 10, 11]))
        snapshot = conn.stats.snapshot()
        stats = snapshot["total"]
        conn.close()
        # the first save compared the pair's pages, copied out of the GPU pools
        assert snapshot["replicas_verified"] == 4 and snapshot["replica_mismatch"] == 0
        results.put((rank, (result.loaded, bad, stats["store_read"]["pages"])))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_a_striped_load_over_gloo_fills_gpu_pools_and_reads_each_page_once(tmp_path):
    from kvconn.testing.ranks import run_ranks

    store = tmp_path / "store"
    store.mkdir()
    out = run_ranks(_striped_into_gpu_pools, 2, (str(store), str(tmp_path / "rv")), timeout_s=180)
    assert all(isinstance(r, tuple) for r in out), out
    assert [(loaded, bad) for loaded, bad, _ in out] == [(4, 0), (4, 0)]
    assert sum(reads for _, _, reads in out) == 4  # each block's page once for the pair


def test_a_replica_probe_copies_a_gpu_pool_s_shared_pages_as_a_cpu_pool_gives_them():
    """The bytes a replica check digests from a GPU pool (copied to pinned host memory on
    the save's stream) are the pool's bytes: the same digests as from a CPU copy."""
    from kvconn.layout import NO_SLOT
    from kvconn.replica_check import ReplicaCheck

    layout = minimax_m3(tp_size=2, layers=2, num_slots=16)
    src = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8, device="cuda")
    hashes = block_hashes(list(range(32 * 4)), 32)
    digests = []
    for pool in (src, src.cpu()):
        conn = Connector(
            ConnectorConfig(model="m", backend="dict"), layout, pools=[pool], backend=DictBackend()
        )
        check = ReplicaCheck(
            conn.keys, rank=0, group=None, calls=conn.calls, stats=conn.stats, every=1
        )
        slots = {0: torch.tensor([3, NO_SLOT, 7, 1])}
        probe = check._probe(hashes, [0, 1, 2, 3], slots, conn._require_pools(), pool.device, ())
        probe.ready()
        digests.append(check._digests(probe, ()))
    assert digests[0] == digests[1]
    assert sum(d != -1 for d in digests[0]) == 3  # index-K of the three blocks with a slot
