"""The Mooncake backend's registry of registered memory, without a server."""

from __future__ import annotations

import ctypes
import itertools

from hypothesis import given
from hypothesis import strategies as st
from kvconn_mooncake._memory import Registry, address_of

ARENA = bytearray(4096)
BASE = ctypes.addressof(ctypes.c_char.from_buffer(ARENA))


def _registry(cuts: list[int], registered: list[bool]) -> Registry:
    """Ranges between consecutive cut points of the arena; some refused by the client."""
    registry = Registry()
    points = sorted(set(cuts))
    for (start, end), ok in zip(itertools.pairwise(points), registered):
        entry = registry.add(memoryview(ARENA)[start:end], BASE + start)
        registry.mark(entry, ok)
    return registry


@given(
    st.lists(st.integers(0, 4096), min_size=2, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
    st.data(),
)
def test_locating_a_batch_agrees_with_checking_each_view_against_each_range(cuts, registered, data):
    registry = _registry(cuts, registered)
    # Views start and end on or next to range edges, where off-by-one errors live.
    edge = st.sampled_from(sorted(set(cuts))).flatmap(
        lambda p: st.integers(max(0, p - 2), min(4096, p + 2))
    )
    views = []
    for _ in range(data.draw(st.integers(0, 30))):
        a, b = sorted((data.draw(edge), data.draw(edge)))
        view = memoryview(ARENA)[a:b]
        views.append(view.toreadonly() if data.draw(st.booleans()) else view)
    expected = []
    for view in views:  # the plain rule, checked range by range
        address = address_of(view)
        inside = address is not None and any(
            r.mooncake and r.start <= address and address + view.nbytes <= r.end
            for r in registry.entries()
        )
        expected.append(address if inside else None)
    assert registry.locate(views) == expected


def test_a_registry_with_a_refused_range_reports_it_until_marked_registered():
    registry = Registry()
    entry = registry.add(memoryview(ARENA)[:100], BASE)
    assert registry.any_failed  # not registered with the client yet
    registry.mark(entry, True)
    assert not registry.any_failed
    other = registry.add(memoryview(ARENA)[200:300], BASE + 200)
    registry.mark(other, False)
    assert registry.any_failed and registry.failed() == [other]
    registry.remove(BASE + 200)
    assert not registry.any_failed
