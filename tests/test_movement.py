import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn.layout import Region
from kvconn.movement import PageMover, compile_runs, scatter_host_pages


def reference_gather(regions, pool, slots):
    return torch.stack(
        [
            torch.cat(
                [pool[r.base + s * r.stride : r.base + s * r.stride + r.size] for r in regions]
            )
            for s in slots
        ]
    )


@st.composite
def interleaved(draw, largest=40):
    num_slots = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, largest), min_size=1, max_size=6))
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(sizes), max_size=len(sizes)))
    offsets, pos = [], draw(st.integers(0, 7))
    for size, gap in zip(sizes, gaps):
        offsets.append(pos)
        pos += size + gap
    stride = pos + draw(st.integers(0, 9))
    regions = [
        Region("k", i, off, size, stride, num_slots)
        for i, (off, size) in enumerate(zip(offsets, sizes))
    ]
    order = draw(st.permutations(range(len(regions))))
    picked = draw(
        st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=num_slots, unique=True)
    )
    return [regions[i] for i in order], stride * num_slots + 16, picked


@settings(max_examples=150, deadline=None)
@given(interleaved(), st.sampled_from([0, 1, 8, 13]))
def test_gather_and_scatter_agree_with_a_byte_by_byte_reference(case, tail):
    # ``tail`` bytes after each page in its row: a staging row's checksum trailer
    regions, pool_size, slots = case
    pool = torch.randint(0, 256, (pool_size,), dtype=torch.uint8)
    mover = PageMover(regions, [pool], regions[0].num_slots)
    index = torch.tensor(slots)
    rows = torch.full((len(slots), mover.page_size + tail), 0xA5, dtype=torch.uint8)
    out = rows[:, : mover.page_size]
    mover.gather(index, out)
    assert torch.equal(out, reference_gather(regions, pool, slots))
    assert bool((rows[:, mover.page_size :] == 0xA5).all())  # the trailers are untouched
    target = torch.zeros_like(pool)
    PageMover(regions, [target], regions[0].num_slots).scatter(index, out)
    touched = torch.zeros(pool_size, dtype=torch.bool)
    for r in regions:
        for s in slots:
            touched[r.base + s * r.stride : r.base + s * r.stride + r.size] = True
    assert torch.equal(target[touched], pool[touched])
    assert int(target[~touched].count_nonzero()) == 0  # nothing outside the pages is written


@settings(max_examples=150, deadline=None)
@given(interleaved())
def test_a_host_page_scatters_into_exactly_the_bytes_its_regions_name(case):
    assert_host_pages_scatter_exactly(case, 1)


# Pieces of 4 KiB and more are written with streaming stores (kvconn/_scatter.c): pieces
# either side of that size, at any alignment of page and pool, with any tail after the
# last whole 64 bytes.
@settings(max_examples=60, deadline=None)
@given(interleaved(largest=9000), st.integers(0, 63))
def test_a_host_page_of_large_pieces_scatters_into_exactly_the_bytes_its_regions_name(case, skew):
    assert_host_pages_scatter_exactly(case, skew)


def assert_host_pages_scatter_exactly(case, skew):
    regions, pool_size, slots = case
    pool = torch.randint(0, 256, (pool_size,), dtype=torch.uint8)
    pages = reference_gather(regions, pool, slots)
    target = torch.zeros_like(pool)
    mover = PageMover(regions, [target], regions[0].num_slots)
    for slot, page in zip(slots, pages):
        # a lent value: read-only bytes at no particular alignment
        mover.scatter_page(slot, memoryview(bytes(skew) + page.numpy().tobytes())[skew:])
    touched = torch.zeros(pool_size, dtype=torch.bool)
    for r in regions:
        for s in slots:
            touched[r.base + s * r.stride : r.base + s * r.stride + r.size] = True
    assert torch.equal(target[touched], pool[touched])
    assert int(target[~touched].count_nonzero()) == 0


def lent_mover():
    regions = [Region("k", 0, 0, 8, 32, 4), Region("k", 1, 16, 8, 32, 4)]
    target = torch.zeros(4 * 32, dtype=torch.uint8)
    return PageMover(regions, [target], 4), target


@pytest.mark.parametrize("slot", [-1, 4])
def test_a_host_page_for_a_slot_outside_the_pool_is_refused_unwritten(slot):
    mover, target = lent_mover()
    with pytest.raises(IndexError, match=f"slot {slot} is outside the pool's 4 slots"):
        mover.scatter_page(slot, memoryview(bytes(range(1, 17))))
    assert int(target.count_nonzero()) == 0


def test_a_host_page_shorter_than_its_pieces_is_refused_unwritten():
    mover, target = lent_mover()
    with pytest.raises(ValueError, match=r"piece 1 \(bytes 8..16\) lies outside a page of 12"):
        mover.scatter_page(1, memoryview(bytes(range(1, 13))))
    assert int(target.count_nonzero()) == 0  # the first piece, which fits, is not written


@settings(max_examples=40, deadline=None)
@given(interleaved(largest=9000), interleaved(), st.integers(0, 63))
def test_host_pages_of_two_pools_scatter_in_one_call_as_they_do_one_by_one(first, second, skew):
    """A group of a lent load: pages of several kinds (each its own mover and pool) in
    one call, the same bytes as a call per page."""
    wanted, got, jobs = [], [], []
    for regions, pool_size, slots in (first, second):
        pool = torch.randint(0, 256, (pool_size,), dtype=torch.uint8)
        pages = reference_gather(regions, pool, slots)
        lent = [memoryview(bytes(skew) + p.numpy().tobytes())[skew:] for p in pages]
        one_by_one = torch.zeros_like(pool)
        mover = PageMover(regions, [one_by_one], regions[0].num_slots)
        for slot, page in zip(slots, lent):
            mover.scatter_page(slot, page)
        together = torch.zeros_like(pool)
        batch = PageMover(regions, [together], regions[0].num_slots)
        jobs += [batch.host_page(slot, page) for slot, page in zip(slots, lent)]
        wanted.append(one_by_one)
        got.append(together)
    scatter_host_pages(jobs[::-1])  # in any order: every page has its own slot
    for w, g in zip(wanted, got):
        assert torch.equal(w, g)


def test_a_group_of_host_pages_with_one_bad_page_is_refused_whole_and_unwritten():
    mover, target = lent_mover()
    good = mover.host_page(0, memoryview(bytes(range(1, 17))))
    with pytest.raises(IndexError, match="slot 4 is outside the pool's 4 slots"):
        scatter_host_pages([good, mover.host_page(4, memoryview(bytes(range(1, 17))))])
    with pytest.raises(ValueError, match=r"piece 1 \(bytes 8..16\) lies outside a page of 12"):
        scatter_host_pages([good, mover.host_page(1, memoryview(bytes(range(1, 13))))])
    with pytest.raises(TypeError, match="page 1 of scatter_pages is not a"):
        scatter_host_pages([good, [memoryview(bytes(16)), 1, 4, b""]])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        scatter_host_pages([good, (memoryview(bytes(16)), "1", 4, b"")])  # type: ignore[list-item]
    assert int(target.count_nonzero()) == 0  # the good page, first, is not written either
    scatter_host_pages([good])
    assert int(target.count_nonzero()) == 16


def test_host_pages_go_into_cpu_pools_only():
    regions = [Region("k", 0, 0, 8, 8, 2)]
    mover = PageMover(regions, [torch.zeros(16, dtype=torch.uint8, device="meta")], 2)
    with pytest.raises(ValueError, match="CPU pools only"):
        mover.scatter_page(0, memoryview(bytes(8)))


def test_adjacent_regions_and_layer_repeats_compile_to_one_run():
    stride = 3 * 64 * 4
    regions = []
    for layer in range(4):
        regions.append(Region("k", layer, layer * 192, 64, stride, 8))
        regions.append(Region("v", layer, layer * 192 + 64, 64, stride, 8))
    runs = compile_runs(regions)
    assert len(runs) == 1 and (runs[0].count, runs[0].size, runs[0].step) == (4, 128, 192)


@pytest.mark.parametrize("tail", [8, 16])
def test_word_aligned_pages_gather_into_and_scatter_from_rows_with_a_trailer(tail):
    # the connector's case: 8-byte words, rows of page_size + trailer in staging
    regions = [Region("k", i, i * 96, 32, 288, 6) for i in range(3)]
    regions += [Region("v", i, i * 96 + 32, 64, 288, 6) for i in range(3)]
    pool = torch.randint(0, 256, (288 * 6,), dtype=torch.uint8)
    mover = PageMover(regions, [pool], 6)
    rows = torch.full((3, mover.page_size + tail), 7, dtype=torch.uint8)
    index = torch.tensor([4, 0, 2])
    mover.gather(index, rows[:, : mover.page_size])
    assert torch.equal(rows[:, : mover.page_size], reference_gather(regions, pool, [4, 0, 2]))
    assert bool((rows[:, mover.page_size :] == 7).all())
    target = torch.zeros_like(pool)
    PageMover(regions, [target], 6).scatter(index, rows[:, : mover.page_size])
    for r in regions:
        for s in (4, 0, 2):
            piece = slice(r.base + s * r.stride, r.base + s * r.stride + r.size)
            assert torch.equal(target[piece], pool[piece])


def test_gather_works_into_a_non_contiguous_destination():
    regions = [Region("k", 0, 0, 16, 48, 4), Region("v", 0, 32, 8, 48, 4)]
    pool = torch.randint(0, 256, (192,), dtype=torch.uint8)
    mover = PageMover(regions, [pool], 4)
    wide = torch.zeros(2, 40, dtype=torch.uint8)
    mover.gather(torch.tensor([3, 1]), wide[:, 4:28])
    assert torch.equal(wide[:, 4:28], reference_gather(regions, pool, [3, 1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_pools_of_any_dtype_move_as_bytes(dtype):
    pool = torch.randn(4, 3, 8).to(dtype)
    regions = [
        Region.from_tensor("k", 0, pool[:, 0], pool),
        Region.from_tensor("v", 0, pool[:, 2], pool),
    ]
    from kvconn.movement import flat_bytes

    flat = flat_bytes(pool)
    mover = PageMover(regions, [flat], 4)
    out = torch.empty(2, mover.page_size, dtype=torch.uint8)
    mover.gather(torch.tensor([2, 0]), out)
    back = torch.zeros_like(pool)
    PageMover(regions, [flat_bytes(back)], 4).scatter(torch.tensor([2, 0]), out)
    assert torch.equal(back[[2, 0]][:, [0, 2]], pool[[2, 0]][:, [0, 2]])
    assert int(back[:, 1].float().count_nonzero()) == 0
