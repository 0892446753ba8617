"""A request's vLLM block ids per KV-cache group, as kvconn slots (no engine)."""

from __future__ import annotations

from kvconn.layout import NO_SLOT
from kvconn_vllm.blocks import BlockTable


def test_null_blocks_of_a_sliding_group_are_kvconn_no_slot():
    """What vLLM allocates for a 4-block hit with a 2-block window: the sliding group
    (0) holds its null block (id 0) for the two blocks outside the window."""
    table = BlockTable([0, 1])
    table.replace(([0, 0, 7, 8], [3, 4, 5, 6]))
    assert table.slots(0, 4) == {0: [NO_SLOT, NO_SLOT, 7, 8], 1: [3, 4, 5, 6]}
    assert table.slots(2, 4) == {0: [7, 8], 1: [5, 6]}


def test_only_the_groups_kvconn_stores_are_kept():
    table = BlockTable([1])
    table.replace(([9], [3, 4]))
    table.extend(([10], [5]))
    assert table.ids == {1: [3, 4, 5]} and len(table) == 3


def test_the_table_grows_by_each_steps_new_ids_and_counts_blocks_every_group_has():
    table = BlockTable([0, 1])
    table.replace(([1], [2, 3]))
    assert len(table) == 1
    table.extend(None)  # a step that allocated nothing
    table.extend(([4], []))
    assert len(table) == 2 and table.slots(0, 2) == {0: [1, 4], 1: [2, 3]}
    table.replace(None)  # resumed with nothing allocated yet
    assert len(table) == 0


def test_the_first_invalid_block_is_found_below_the_saved_count_only():
    table = BlockTable([0])
    table.replace(([5, 6, 7, 8],))
    assert table.first_in(0, {7, 8}, 4) == 2
    assert table.first_in(0, {7, 8}, 2) is None
