"""The CUDA path: pools on the GPU, pages staged through pinned host memory.

Runs only where a GPU is present (never in CI here); the same rules as on the CPU.
"""

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
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
