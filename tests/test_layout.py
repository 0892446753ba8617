import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn.errors import LayoutError
from kvconn.layout import (
    Chunked,
    KvLayout,
    LayerGroup,
    Region,
    Role,
    Window,
    _strided_overlap,
    shard_position,
)
from kvconn.plan import plan_pages


def layout(regions, *, roles=None, tp=8, pool=10_000, slots=4):
    roles = roles or (Role("k", 8, "bf16"), Role("v", 8, "bf16"), Role("index_k", 1, "bf16"))
    return KvLayout(tp, 32, roles, (LayerGroup(0, slots, tuple(regions)),), (pool,))


@pytest.mark.parametrize(
    ("rank", "tp", "units", "expected"),
    [
        (5, 8, 8, (8, 1, 5, 0)),
        (5, 8, 4, (4, 2, 2, 1)),  # GQA: 4 KV heads at TP=8, pairs of ranks
        (5, 8, 1, (1, 8, 0, 5)),  # replicated
        (1, 2, 8, (2, 1, 1, 0)),  # more units than ranks
        (0, 1, 8, (1, 1, 0, 0)),
    ],
)
def test_shard_position_follows_the_design_formula(rank, tp, units, expected):
    pos = shard_position(rank, tp, units)
    assert (pos.num_shards, pos.dup, pos.shard_index, pos.replica_index) == expected


def test_units_inconsistent_with_tp_are_a_configuration_error():
    with pytest.raises(LayoutError, match="units=3 neither divides nor is divisible by tp_size=8"):
        shard_position(0, 8, 3)
    with pytest.raises(LayoutError, match="units=6"):
        KvLayout(
            8, 32, (Role("k", 6, "bf16"),), (LayerGroup(0, 1, (Region("k", 0, 0, 8, 8, 1),)),), (8,)
        )


def test_overlapping_regions_are_rejected_naming_both():
    regions = [Region("k", 0, 0, 100, 300, 4), Region("v", 0, 50, 100, 300, 4)]
    with pytest.raises(
        LayoutError, match=r"region k@layer0 overlaps layer group 0, region v@layer0"
    ):
        layout(regions)


def test_interleaved_regions_that_do_not_touch_are_accepted():
    regions = [
        Region("k", 0, 0, 100, 300, 4),
        Region("v", 0, 100, 100, 300, 4),
        Region("index_k", 0, 200, 100, 300, 4),
    ]
    assert len(layout(regions).groups[0].regions) == 3


def test_overlap_between_later_slots_of_differently_strided_regions_is_found():
    # slot 3 of k (900..1000) meets slot 1 of v (950..1000): only later slots collide
    regions = [Region("k", 0, 0, 100, 300, 4), Region("v", 0, 450, 50, 500, 4)]
    with pytest.raises(LayoutError, match="overlaps"):
        layout(regions, pool=20_000)


def test_slots_out_of_bounds_are_rejected_with_the_group_and_region():
    with pytest.raises(LayoutError, match=r"layer group 0, region k@layer0: slots out of bounds"):
        layout([Region("k", 0, 0, 100, 300, 4)], pool=999)


def test_a_region_with_its_own_slot_count_is_rejected():
    with pytest.raises(LayoutError, match="has its own slot count 3"):
        layout([Region("k", 0, 0, 100, 300, 4), Region("v", 0, 100, 100, 300, 3)])


@pytest.mark.parametrize("field", ["size", "stride", "num_slots"])
def test_zero_or_negative_sizes_are_rejected(field):
    kwargs: dict[str, Any] = {
        "role": "k",
        "layer": 0,
        "base": 0,
        "size": 8,
        "stride": 8,
        "num_slots": 2,
    }
    for bad in (0, -8):
        kwargs[field] = bad
        with pytest.raises(LayoutError, match=field):
            Region(**kwargs)


def test_a_stride_smaller_than_the_size_is_rejected():
    with pytest.raises(LayoutError, match="consecutive slots of the region overlap"):
        Region("k", 0, 0, 100, 50, 4)


def test_an_unknown_role_is_rejected_listing_the_declared_ones():
    with pytest.raises(LayoutError, match=r"unknown role 'q' \(declared roles: index_k, k, v\)"):
        layout([Region("q", 0, 0, 100, 300, 4)])


def test_a_region_declared_twice_is_rejected():
    with pytest.raises(LayoutError, match="declared twice"):
        layout([Region("k", 0, 0, 100, 300, 4), Region("k", 0, 100, 100, 300, 4)])


def test_a_region_in_an_undeclared_pool_is_rejected():
    with pytest.raises(LayoutError, match="pool 1 does not exist"):
        layout([Region("k", 0, 0, 100, 300, 4, pool=1)])


def test_regions_are_described_from_torch_tensors():
    pool = torch.zeros(4, 3, 16, dtype=torch.bfloat16)  # slots x roles x elements
    k = Region.from_tensor("k", 0, pool[:, 0], pool)
    idx = Region.from_tensor("index_k", 0, pool[:, 2], pool)
    assert (k.base, k.size, k.stride, k.num_slots) == (0, 32, 96, 4)
    assert (idx.base, idx.size, idx.stride) == (64, 32, 96)


def test_a_tensor_whose_slot_bytes_are_not_contiguous_is_rejected():
    pool = torch.zeros(4, 16, 8, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="not contiguous"):
        Region.from_tensor("k", 0, pool[:, :, 0], pool)


@pytest.mark.parametrize("empty", [slice(0, 0), slice(2, 2)], ids=["no slots", "past the end"])
def test_an_empty_tensor_is_refused_as_empty_not_as_lying_outside_its_pool(empty):
    """Issue 15: ``pool[:0]`` was "the tensor does not lie inside pool 0"."""
    pool = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    for view in (pool[empty], pool[:, 0, :0]):
        with pytest.raises(LayoutError, match=r"region k@layer0: the tensor is empty \(shape"):
            Region.from_tensor("k", 0, view, pool)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Role("k", 8, "bf16\x00"), "dtype 'bf16\\\\x00' must be non-empty printable ASCII"),
        (lambda: Role("k", 8, "bf16\n"), "printable ASCII"),
        (lambda: Role("k", 8, "bf16\u200b"), "printable ASCII"),  # zero-width space
        (lambda: Role("k", 8, "bf\u00e916"), "printable ASCII"),
        (
            lambda: LayerGroup(0, 1, (Region("k", 0, 0, 8, 8, 1),), name="full\nattention"),
            "layer group 0: name 'full\\\\nattention' must be printable text",
        ),
    ],
)
def test_text_that_reaches_a_key_a_manifest_or_a_label_refuses_control_characters(make, message):
    with pytest.raises(LayoutError, match=message):
        make()


def test_a_stored_manifest_may_not_claim_a_dtype_or_role_name_no_layout_could_declare():
    """Tools print manifests read from a store: they get the rules layouts get."""
    from kvconn.manifest import ManifestError, PageManifest

    good = PageManifest(32, "w8", (("k", 8, "bf16"),), ((0, "k", 64),))
    for field, bad in (("dtype", "bf16\u0000"), ("dtype", "bf16\u001b[2J")):
        doc = json.loads(good.to_json())
        doc["roles"]["k"][field] = bad
        with pytest.raises(ManifestError, match="printable ASCII"):
            PageManifest.from_json(json.dumps(doc))
    doc = json.loads(good.to_json())
    doc["roles"]["k\n"] = doc["roles"].pop("k")
    doc["regions"] = [[0, "k\n", 64]]
    with pytest.raises(ManifestError, match="role name"):
        PageManifest.from_json(json.dumps(doc))
    assert PageManifest.from_json(good.to_json()) == good


def test_roles_need_valid_names_units_and_dtypes():
    with pytest.raises(LayoutError, match="role name"):
        Role("K/V", 8, "bf16")
    with pytest.raises(LayoutError, match="units must be an int >= 1"):
        Role("k", 0, "bf16")
    with pytest.raises(LayoutError, match="dtype"):
        Role("k", 8, "")


@st.composite
def _regions(draw: st.DrawFn, role: str) -> Region:
    num_slots = draw(st.integers(1, 12))
    size = draw(st.integers(1, 40))
    # equal strides take the analytic path, mixed ones the per-slot path
    stride = draw(st.sampled_from([40, 48, 60]) | st.integers(size, 60)) if num_slots > 1 else 0
    return Region(role, 0, draw(st.integers(0, 200)), size, stride, num_slots)


@settings(max_examples=400, deadline=None)
@given(_regions("k"), _regions("v"))
def test_overlap_check_agrees_with_comparing_every_byte(a, b):
    """The analytic and the per-slot paths must find exactly the byte-level overlaps."""

    def touched(r: Region) -> set[int]:
        return {r.base + i * r.stride + x for i in range(r.num_slots) for x in range(r.size)}

    assert _strided_overlap(a, b) == bool(touched(a) & touched(b))
    assert _strided_overlap(b, a) == bool(touched(a) & touched(b))


# ------------------------------------------------ wrong types (issue 11)
_ROLE = Role("k", 1, "bf16")
_REGION = Region("k", 0, 0, 16, 16, 4)
_GROUP = LayerGroup(0, 4, (_REGION,))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KvLayout(1, 4, None, (_GROUP,), (64,)), "roles must be a tuple or list, got None"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4, "k", (_GROUP,), (64,)), "roles must be a tuple or list, got 'k'"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4, (_ROLE,), None, (64,)), "groups must be a tuple or list"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4, (_ROLE,), [5], (64,)), "groups must be LayerGroup objects, got 5"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4, (_ROLE,), (_GROUP,), 64), "pool_sizes must be a tuple or list"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4, (_ROLE,), (_GROUP,), [64.0]), r"pool_sizes\[0\] must be an int"),  # type: ignore[arg-type]
        (lambda: KvLayout(1, 4.0, (_ROLE,), (_GROUP,), (64,)), "tokens_per_block must be an int"),  # type: ignore[arg-type]
        (lambda: LayerGroup(0, 4, None), "regions must be a tuple or list, got None"),  # type: ignore[arg-type]
        (lambda: LayerGroup(0, 4, _REGION), "regions must be a tuple or list"),  # type: ignore[arg-type]
        (lambda: LayerGroup(0, 4, (_REGION,), name=5), "name must be a string, got 5"),  # type: ignore[arg-type]
        (lambda: Region(None, 0, 0, 16, 16, 4), "role must be a role name, got None"),  # type: ignore[arg-type]
        (lambda: Role("k\n", 1, "bf16"), "role name 'k\\\\n'"),  # type: ignore[arg-type]
        (lambda: Region.from_tensor("k", 0, None, torch.zeros(4)), "view must be a torch.Tensor"),  # type: ignore[arg-type]
    ],
)
def test_descriptions_of_the_wrong_type_are_layout_errors_naming_the_field(make, message):
    with pytest.raises(LayoutError, match=message):
        make()


def test_regions_in_a_set_are_refused_because_their_order_is_the_page_order():
    other = Region("v", 0, 16, 16, 32, 4)
    with pytest.raises(LayoutError, match="regions must be a tuple or list"):
        LayerGroup(0, 4, {_REGION, other})  # type: ignore[arg-type]
    assert LayerGroup(0, 4, [_REGION, other]).regions == (_REGION, other)  # type: ignore[arg-type]


def _two_pool_layout(window: Window = 2) -> KvLayout:
    roles = (Role("k", 2, "bf16"), Role("v", 2, "bf16"), Role("index_k", 1, "fp8+scale"))
    groups = (
        LayerGroup(0, 4, (Region("k", 0, 0, 64, 128, 4), Region("v", 0, 64, 64, 128, 4))),
        LayerGroup(
            3,
            2,
            (Region("index_k", 1, 0, 32, 32, 2, pool=1), Region("k", 1, 512, 8, 8, 2)),
            "swa",
            window=window,
        ),
    )
    return KvLayout(2, 32, roles, groups, (600, 64))


@pytest.mark.parametrize("window", [2, Chunked(4)])
def test_a_layout_round_trips_through_json_exactly(window):
    original = _two_pool_layout(window)
    text = json.dumps(original.to_dict())
    restored = KvLayout.from_dict(json.loads(text))
    assert restored == original
    assert restored.to_dict() == original.to_dict()
    assert plan_pages(restored) == plan_pages(original)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("tp_size"), r"layout: missing field\(s\) \['tp_size'\]"),
        (lambda d: d.update(pools=[1]), r"unknown field\(s\) \['pools'\]"),
        (lambda d: d.update(version=2), "version 2 is not 3 or 4"),
        (
            lambda d: d["groups"][1].update(window={"chunk": 4}),
            r"groups\[1\].window: missing field\(s\) \['chunk_blocks'\]",
        ),
        (
            lambda d: d["groups"][1].update(window={"chunk_blocks": 0}),
            r"blocks \(per attention chunk\) must be > 0",
        ),
        (lambda d: d["groups"][0].pop("window"), r"groups\[0\]: missing field\(s\) \['window'\]"),
        (
            lambda d: d["groups"][1].update(window=0),
            r"window \(blocks, Chunked, or None\) must be > 0",
        ),
        (lambda d: d.update(groups={}), "layout.groups: must be a list"),
        (lambda d: d["roles"][0].update(units="2"), "units must be an int"),
        (lambda d: d["groups"][1]["regions"][0].pop("pool"), r"regions\[0\]: missing.*'pool'"),
        (lambda d: d["groups"][0]["regions"][1].update(base=32), "overlaps"),
        (lambda d: d["groups"][1].update(name=None), r"groups\[1\]: name must be a string"),
        (lambda d: d.update(roles=[1]), r"layout.roles\[0\]: must be an object"),
    ],
)
def test_a_layout_dict_is_validated_on_the_way_in(edit, message):
    data = json.loads(json.dumps(_two_pool_layout().to_dict()))
    edit(data)
    with pytest.raises(LayoutError, match=message):
        KvLayout.from_dict(data)


@pytest.mark.parametrize("window", [0, -2, 1.5, True, "2"])
def test_a_group_window_is_a_number_of_blocks_or_none(window):
    with pytest.raises(LayoutError, match=r"layer group 0: window \(blocks, Chunked, or None\)"):
        LayerGroup(0, 4, (_REGION,), window=window)
    assert LayerGroup(0, 4, (_REGION,), window=3).window == 3
    assert LayerGroup(0, 4, (_REGION,), window=Chunked(8)).window == Chunked(8)
    assert LayerGroup(0, 4, (_REGION,)).window is None


def test_a_version_3_layout_dict_still_reads():
    """Version 4 only added the chunked window's form; a version 3 dict means the same."""
    data = _two_pool_layout().to_dict() | {"version": 3}
    assert KvLayout.from_dict(data) == _two_pool_layout()
