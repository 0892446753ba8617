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


def test_a_state_groups_blocks_are_slots_only_where_vllm_names_a_state():
    """vLLM's Mamba table after three blocks in align mode: interior states nulled, and
    block 9 at position 2 a running state, not the one after block 2. A save takes the
    states vLLM names ({position: block}); elsewhere the state group has no slot."""
    table = BlockTable([0, 1], state_groups=[0])
    table.replace(([0, 4, 9], [2, 3, 5]))
    assert table.slots(0, 3) == {0: [NO_SLOT] * 3, 1: [2, 3, 5]}
    assert table.slots(0, 3, {0: {1: 4}}) == {0: [NO_SLOT, 4, NO_SLOT], 1: [2, 3, 5]}
    assert table.slots(2, 3, {0: {1: 4}}) == {0: [NO_SLOT], 1: [5]}  # out of range


def test_a_load_puts_the_state_in_the_block_vllm_allocated_at_the_hits_end():
    table = BlockTable([0, 1], state_groups=[0])
    table.replace(([0, 0, 6], [2, 3, 5]))  # a 3-block hit: nulls, then the resume block
    assert table.slots(0, 3, table.resume_states(2)) == {0: [NO_SLOT, NO_SLOT, 6], 1: [2, 3, 5]}
    assert table.resume_states(3) == {}  # past the table: nothing to name
