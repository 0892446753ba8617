"""`kvconn inspect`: a store's footprint by model, shard class and layer group, from keys."""

from __future__ import annotations

import json

import lmdb
import pytest

import kvconn.inspect
from kvconn.cli import main
from kvconn.hashing import block_hashes
from kvconn.inspect import footprint, parse_key
from kvconn.keys import key_prefix, page_key
from tests.fakes import DictBackend

HASH = block_hashes(list(range(32)), 32)[0]


def test_a_page_key_parses_back_into_its_parts_with_the_model_unquoted():
    key = page_key(key_prefix("ns", "Org/Model-FP8 v2"), "w4r3", 1, "t32b16384-abcdef", HASH)
    page = parse_key(key)
    assert page is not None
    assert (page.namespace, page.model, page.shard, page.shard_class) == (
        "ns",
        "Org/Model-FP8 v2",
        "w4r3",
        "w4",
    )
    assert (page.group, page.tokens_per_block, page.page_bytes) == (1, 32, 16384)
    assert page.block_hash == HASH.hex()
    replicated = parse_key(page_key("kvconn/m/", "replicated", 0, "t16b8-00", HASH))
    assert replicated is not None and replicated.shard_class == "replicated"


@pytest.mark.parametrize(
    "key",
    [
        "",
        "a/b/c",
        "kvconn/m/w4r4/lg0/t32b8-ab/00",
        "kvconn/m/x/lg0/t32b8-ab/00",
        "kvconn/m/replicated/g0/t32b8-ab/00",
        "kvconn/m/replicated/lg0/32b8/00",
        "kvconn/m/replicated/lg0/t32b8-ab/xyz",
        "kvconn/m/replicated/lg0/t32b8-ab/00/extra",
    ],
)
def test_keys_that_are_not_page_keys_are_counted_apart(key):
    assert parse_key(key) is None
    fp = footprint([(key, 10)])
    assert (fp.other_keys, fp.other_bytes, fp.rows) == (1, 10, {})


def test_the_footprint_groups_pages_by_model_class_and_group():
    prefix = key_prefix("kvconn", "m")
    entries = [(page_key(prefix, f"w2r{r}", 0, "t32b100-aa", HASH), 100) for r in (0, 1)]
    entries += [(page_key(prefix, "replicated", 0, "t32b40-bb", HASH), 40)]
    entries += [(page_key(prefix, "replicated", 1, "t32b40-bb", HASH), 39)]  # truncated
    result = footprint(entries).as_dict()
    (model,) = result["models"]
    assert (model["pages"], model["bytes"]) == (4, 279)
    assert (model["replicated_bytes"], model["sharded_bytes"]) == (79, 200)
    rows = {(c["shard_class"], c["layer_group"]): c for c in model["classes"]}
    assert rows[("w2", 0)]["shards_present"] == 2 and rows[("w2", 0)]["blocks"] == 1
    assert rows[("replicated", 1)]["size_mismatches"] == 1


@pytest.mark.slow
def test_inspect_reports_what_simulate_stored(capsys, tmp_path):
    store = str(tmp_path / "store")
    args = [
        "--path",
        store,
        "--layers",
        "1",
        "--conversations",
        "3",
        "--turns",
        "2",
        "--system-tokens",
        "64:128",
        "--no-progress",
        "--json",
    ]
    assert main(["simulate", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    env = lmdb.open(store, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"not-a-page-key", b"xyz")
    env.close()

    assert main(["inspect", "--path", store, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (model,) = result["models"]
    assert model["model"] == "minimax-m3" and model["namespace"] == "kvconn"
    assert model["bytes"] == report["bytes_stored"]
    classes = {c["shard_class"]: c for c in model["classes"]}
    replicated_pages = report["pages_written_by_role"]["index_k"]
    assert classes["replicated"]["pages"] == replicated_pages
    assert classes["w8"]["pages"] == 8 * replicated_pages
    assert classes["w8"]["shards_present"] == 8
    assert result["other_keys"] == 1 and result["other_bytes"] == 3

    assert main(["inspect", "--path", store]) == 0
    text = capsys.readouterr().out
    assert "kvconn/minimax-m3" in text and "replicated" in text and "w8" in text
    assert "1 other key(s)" in text


def test_inspect_of_an_empty_store_says_so(capsys, tmp_path):
    assert main(["inspect", "--path", str(tmp_path / "empty")]) == 0
    assert "(empty)" in capsys.readouterr().out


def test_a_backend_that_cannot_list_gets_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(kvconn.inspect, "backend_class", lambda name: DictBackend)
    monkeypatch.setattr(kvconn.inspect, "_listing_backends", lambda: ["lmdb", "redis"])
    assert main(["inspect", "--backend", "dict"]) == 2
    err = capsys.readouterr().err
    assert "'dict' backend cannot list its keys" in err
    assert "backends that can: lmdb, redis" in err
