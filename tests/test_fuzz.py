"""Random configuration, layouts and connector calls: only kvconn's own errors escape.

Bad input must end in an error that names it (a :class:`~kvconn.errors.KvconnError`),
never in a bare ``TypeError``/``AttributeError``/``OverflowError`` traceback from deep
inside. Each test starts from a valid input and changes up to a few of its parts (a
value of the wrong type, of absurd size, an element dropped or doubled), so that both
what is accepted and what is refused are exercised; any exception that is not kvconn's
fails the test. Where a call succeeds, the properties that must then hold are checked.
Run with ``--hypothesis-show-statistics`` to see how many inputs were accepted.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import KvconnError
from kvconn.hashing import DIGEST_SIZE, ReuseScope, block_hashes
from kvconn.layout import KvLayout, LayerGroup, Region, Role
from kvconn.registry import load_backend
from kvconn.tools.models import minimax_m3
from tests.fakes import DictBackend
from tests.helpers import tp_group

FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

#: Values of every kind a TOML file, an environment variable or a careless caller gives.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["256MiB", "1g", "99999999T", "9" * 40, "spread", "first", "", "k", "lmdb"]),
    st.sampled_from(["\udcc3\udca9", "\ud800", "a\x00b", "\u00e9/x"]),  # C-locale text, NUL
    st.binary(max_size=DIGEST_SIZE),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@dataclass
class Call:
    """A constructor call drawn as data: built inside the test, so that a refusal while
    building a part (a Role, a Region) counts as the answer under test."""

    cls: Any
    args: list[Any]


def arguments(*values: Any) -> list[Any]:
    """A call's positional arguments, as a Call: their number is never mutated."""
    return list(values)


def build(tree: Any) -> Any:
    if isinstance(tree, Call):
        return tree.cls(*[build(a) for a in tree.args])
    if isinstance(tree, list):
        return [build(item) for item in tree]
    if isinstance(tree, dict):
        return {k: build(v) for k, v in tree.items()}
    return tree


def _places(tree: Any) -> list[tuple[list[Any] | dict[Any, Any], Any, bool]]:
    """Every (container, index, resizable) in ``tree`` whose value a mutation may
    replace; a Call's arguments keep their number, lists of data may shrink or grow."""
    out: list[tuple[list[Any] | dict[Any, Any], Any, bool]] = []
    if isinstance(tree, Call):
        items: Any = tree.args
    elif isinstance(tree, (list, dict)):
        items = tree
    else:
        return out
    keys = list(items) if isinstance(items, dict) else range(len(items))
    for key in keys:
        out.append((items, key, isinstance(tree, list)))
        out.extend(_places(items[key]))
    return out


@st.composite
def mutated(draw: Any, base: Any, max_changes: int = 2) -> Any:
    """``base`` (a tree of Calls, lists and dicts) with up to ``max_changes`` parts
    replaced by junk, or a list element dropped or doubled."""
    root = [copy.deepcopy(draw(base))]
    # a third of the inputs unchanged at least: what is accepted must behave too
    for _ in range(draw(st.sampled_from([0, 0, *range(1, max_changes + 1)]))):
        container, key, resizable = draw(st.sampled_from(_places(root)))
        how = draw(st.sampled_from(["junk", "junk", "drop", "double"]))
        if how == "junk" or not resizable or container is root:
            container[key] = draw(JUNK)
        elif how == "drop":
            del container[key]
        else:
            container.insert(key, copy.deepcopy(container[key]))  # type: ignore[union-attr]
    return root[0]


def kvconn_errors_only(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``'s result, or ``None`` when it refused the input with a kvconn error."""
    name = getattr(fn, "__name__", "call")
    try:
        result = fn(*args, **kwargs)
    except KvconnError as exc:
        assert str(exc), "a kvconn error must say what is wrong"
        event(f"{name}: {type(exc).__name__}")  # --hypothesis-show-statistics
        return None
    event(f"{name}: accepted")
    return result


# ---------------------------------------------------------------- configuration
CONFIG_KEYS = [
    "model",
    "backend",
    "options",
    "namespace",
    "writer_policy",
    "staging_bytes",
    "retry_interval_s",
]
VALID_CONFIG = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "Org/Model-FP8@rev", "modèle"])},
    optional={
        "backend": st.sampled_from(["lmdb", "redis", "dict"]),
        "options": st.fixed_dictionaries(
            {}, optional={"password": st.text().map(lambda t: f"pw<{t}>"), "db": JUNK}
        ),
        "namespace": st.sampled_from(["kvconn", "prod"]),
        "writer_policy": st.sampled_from(["spread", "first"]),
        "staging_bytes": st.one_of(st.integers(1, 2**40), st.sampled_from(["64MiB", "1g"])),
        "retry_interval_s": st.floats(0, 86_400),
    },
)


@st.composite
def config_dicts(draw: Any) -> Any:
    data = draw(VALID_CONFIG)
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from([*CONFIG_KEYS, "writer_polcy", 7]))
        data[key] = draw(JUNK)
    return draw(st.one_of(st.just(data), st.just(data), st.just(data), JUNK))


@FUZZ
@given(data=config_dicts())
def test_configuration_dicts_are_accepted_or_refused_with_a_config_error(data):
    config = kvconn_errors_only(ConnectorConfig.from_dict, data)
    if config is not None:
        assert 1 <= config.staging_bytes <= 2**40
        assert math.isfinite(config.retry_interval_s) and 0 <= config.retry_interval_s <= 86_400
        if isinstance(config.options.get("password"), str):
            assert config.options["password"] not in repr(config)


ENV_NAMES = [
    "KVCONN_BACKEND",
    "KVCONN_STAGING_BYTES",
    "KVCONN_RETRY_INTERVAL_S",
    "KVCONN_WRITER_POLICY",
    "KVCONN_OPTION_",
    "KVCONN_OPTION_MAP_SIZE",
    "KVCONN_TYPO",
    "HOME",
]


@FUZZ
@given(
    env=st.dictionaries(
        st.sampled_from(ENV_NAMES),
        st.one_of(st.sampled_from(["lmdb", "1g", "0.5", "first", "[", "9" * 30]), st.text()),
        max_size=3,
    ),
    base=st.one_of(VALID_CONFIG, VALID_CONFIG, JUNK),
)
def test_environment_variables_are_accepted_or_refused_with_a_config_error(env, base):
    kvconn_errors_only(ConnectorConfig.from_env, env, base)


@FUZZ
@given(
    options=st.fixed_dictionaries(
        {},
        optional={
            "map_size": st.one_of(st.integers(1 << 20, 1 << 32), JUNK),
            "max_map_size": st.one_of(st.integers(1 << 30, 1 << 34), JUNK),
            "sync": st.one_of(st.booleans(), JUNK),
            "max_readers": st.one_of(st.integers(1, 1024), JUNK),
            "readonly": st.one_of(st.booleans(), JUNK),
            "path": st.one_of(st.just("ok"), JUNK),
        },
    )
)
def test_lmdb_options_are_accepted_or_refused_with_a_kvconn_error(tmp_path_factory, options):
    root = tmp_path_factory.getbasetemp() / "fuzz-lmdb"
    if options.get("path") == "ok":
        options["path"] = str(root)
    elif "path" in options and not isinstance(options["path"], str):
        pass  # junk: must be refused
    else:
        options["path"] = str(root)  # never a store in the working directory
    backend = kvconn_errors_only(load_backend, "lmdb", options)
    if backend is not None:
        backend.close()


# ---------------------------------------------------------------- layouts
@st.composite
def layout_calls(draw: Any) -> Call:
    """A valid layout: roles interleaved per layer in one pool (as TensorRT-LLM lays
    out MiniMax-M3), as a tree of Calls."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    slots = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 3))
    roles = [("k", draw(st.sampled_from([8, 16]))), ("v", 8), ("index_k", 1)]
    sizes = [draw(st.integers(1, 48)) for _ in roles]
    stride = sum(sizes) * layers
    regions = []
    for layer in range(layers):
        offset = layer * sum(sizes)
        for (name, _), size in zip(roles, sizes):
            regions.append(Call(Region, [name, layer, offset, size, stride, slots, 0]))
            offset += size
    return Call(
        KvLayout,
        [
            tp,
            draw(st.integers(1, 64)),
            [Call(Role, [name, units, "bf16"]) for name, units in roles],
            [Call(LayerGroup, [0, slots, regions])],
            [stride * slots],
        ],
    )


@FUZZ
@given(tree=mutated(layout_calls()))
def test_layouts_are_built_or_refused_with_a_layout_error(tree):
    if not isinstance(tree, Call):
        return  # the layout was replaced as a whole: nothing to build
    layout = kvconn_errors_only(build, tree)
    if layout is not None:
        for group in layout.groups:
            for region in group.regions:
                assert region.end <= layout.pool_sizes[region.pool]
                assert region.num_slots == group.num_slots


# ---------------------------------------------------------------- connector calls
LAYOUT = minimax_m3(tp_size=2, layers=1, num_slots=6)
HASHES = block_hashes(list(range(32 * 4)), 32)


@st.composite
def call_arguments(draw: Any) -> Call:
    """(hashes, slots): valid (a prefix of a request, distinct slots), slots sometimes
    given per layer group."""
    n = draw(st.integers(0, 4))
    slots = draw(st.permutations(range(6)))[:n]
    return Call(arguments, [list(HASHES[:n]), draw(st.sampled_from([slots, {0: slots}]))])


@pytest.fixture(scope="module")
def group() -> list[Connector]:
    return tp_group(LAYOUT, DictBackend())


@FUZZ
@given(tree=mutated(call_arguments()))
def test_connector_calls_succeed_or_refuse_the_input_with_a_kvconn_error(group, tree):
    hashes, slots = build(tree) if isinstance(tree, Call) else (tree, [])
    for conn in group:
        found = kvconn_errors_only(conn.lookup, hashes)
        if found is not None:
            assert 0 <= found.blocks <= len(hashes)
        saved = kvconn_errors_only(conn.save, hashes, slots)
        loaded = kvconn_errors_only(conn.load, hashes, slots)
        if saved is not None or loaded is not None:
            # accepted: one slot per block, and no slot shared by two different blocks
            given_slots = [int(s) for s in (slots[0] if isinstance(slots, dict) else slots)]
            assert len(given_slots) == len(hashes)
            owner = dict(zip(given_slots, hashes))
            assert all(owner[s] == h for s, h in zip(given_slots, hashes))
        if loaded is not None:
            assert loaded.loaded + len(loaded.failed) == len(hashes)


@FUZZ
@given(
    tree=mutated(
        st.just(
            Call(
                arguments,
                [
                    {"model": "m", "backend": "dict"},
                    LAYOUT,
                    1,
                    [torch.zeros(sum(LAYOUT.pool_sizes), dtype=torch.uint8)],
                ],
            )
        ),
        max_changes=1,
    )
)
def test_connectors_are_built_or_refused_with_a_kvconn_error(tree):
    if isinstance(tree, Call):
        config, layout, rank, pools = build(tree)
        kvconn_errors_only(Connector, config, layout, rank=rank, pools=pools, backend=DictBackend())


# ---------------------------------------------------------------- block hashes
@FUZZ
@given(
    tree=mutated(
        st.builds(
            lambda *args: Call(arguments, list(args)),
            st.lists(st.integers(0, 2**20), max_size=70),
            st.integers(1, 40),
            st.sampled_from([None, Call(ReuseScope, ["tenant", "lora-1", [b"img"]])]),
        )
    )
)
def test_block_hashes_are_computed_or_the_input_refused_with_a_kvconn_error(tree):
    if not isinstance(tree, Call):
        return  # the arguments were replaced as a whole: nothing to call

    def hash_blocks() -> tuple[Any, Any, list[bytes]]:
        tokens, tokens_per_block, scope = build(tree.args)  # a ReuseScope may refuse
        return tokens, tokens_per_block, block_hashes(tokens, tokens_per_block, scope)

    done = kvconn_errors_only(hash_blocks)
    if done is not None:
        tokens, tokens_per_block, hashes = done
        assert len(hashes) == len(tokens) // tokens_per_block
        assert all(len(h) == DIGEST_SIZE for h in hashes)
