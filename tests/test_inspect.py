"""`kvconn inspect`: a store's footprint by model, role, shard class and layer group."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import lmdb
import pytest

import kvconn.tools.inspect_store
from kvconn.hashing import block_hashes
from kvconn.keys import key_prefix, manifest_key, page_key, parse_key, parse_manifest_key
from kvconn.manifest import ManifestError, PageManifest
from kvconn.plan import plan_pages
from kvconn.registry import load_backend
from kvconn.tools.cli import main
from kvconn.tools.inspect_store import footprint
from kvconn.tools.models import PRESETS, minimax_m3
from tests.fakes import DictBackend
from tests.helpers import tp_group

HASH = block_hashes(list(range(32)), 32)[0]
N = 6
HASHES = block_hashes(list(range(32 * N)), 32)


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
    # every rank process wrote the layout manifests: the bytes split by role exactly
    roles = model["role_bytes"]
    assert roles == report["bytes_written_by_role"]
    assert roles["k"] == roles["v"] == 8 * roles["index_k"]
    assert model["unknown_role_bytes"] == 0 and model["manifest_keys"] == 2

    assert main(["inspect", "--path", store]) == 0
    text = capsys.readouterr().out
    assert "kvconn/minimax-m3" in text and "replicated" in text and "w8" in text
    assert "1 other key(s)" in text
    assert "by role: index_k" in text


def test_inspect_of_an_empty_store_says_so(capsys, tmp_path):
    load_backend("lmdb", {"path": str(tmp_path / "empty")}).close()
    assert main(["inspect", "--path", str(tmp_path / "empty")]) == 0
    assert "(empty)" in capsys.readouterr().out


def test_inspect_of_a_path_without_a_store_says_so_and_creates_nothing(capsys, tmp_path):
    """Inspect opens read-only: a mistyped --path used to leave an empty store behind
    and report it as empty, which reads as "the cache is empty"."""
    typo = tmp_path / "sotre"
    assert main(["inspect", "--path", str(typo)]) == 2
    assert f"there is no store at {typo}" in capsys.readouterr().err
    assert not typo.exists()


def test_inspect_checks_every_field_of_its_config_file_and_filters_by_its_namespace(
    capsys, tmp_path
):
    store = tmp_path / "store"
    write_minimax_store(store)
    path = tmp_path / "kvconn.toml"
    path.write_text("model = 5\n")
    assert main(["inspect", "--config", str(path), "--path", str(store)]) == 2
    assert "model must be a non-empty string, got 5" in capsys.readouterr().err
    path.write_text('namespace = "other ns"\n')
    result = inspect_json(capsys, store, "--config", str(path))
    assert (result["prefix"], result["keys"]) == ("other%20ns/", 0)  # spelt as keys spell it


def test_inspect_reads_backend_options_from_kvconn_option_variables(capsys, tmp_path, monkeypatch):
    """So that a secret (a Redis password) need not be on the command line."""
    store = tmp_path / "store"
    write_minimax_store(store)
    monkeypatch.setenv("KVCONN_OPTION_PATH", str(store))
    assert main(["inspect", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == f"lmdb at {store}"
    elsewhere = tmp_path / "elsewhere"
    load_backend("lmdb", {"path": str(elsewhere)}).close()
    assert main(["inspect", "--json", "-o", f"path={elsewhere}"]) == 0  # flags win
    assert json.loads(capsys.readouterr().out)["store"] == f"lmdb at {elsewhere}"


def test_inspect_never_prints_a_password_given_in_a_url_or_an_option(capsys, caplog, monkeypatch):
    """The store is unreachable (a closed port), so the error path is what is shown."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens
    monkeypatch.setenv("KVCONN_OPTION_PASSWORD", "hunter2-env")
    caplog.set_level(logging.DEBUG)  # what a log handler would have printed, and more
    url = f"url=redis://alice:hunter2-url@127.0.0.1:{port}/0"
    assert main(["inspect", "--backend", "redis", "-o", url, "--json"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert "hunter2" not in out + err + caplog.text


# ------------------------------------------------ keys other programs wrote (issue 11)
def _write_foreign_keys(path: Path) -> None:
    rewrite(
        path,
        lambda txn: [
            txn.put(key, b"12345")
            for key in (
                b"\xff\xfe/not-utf8",
                "\u00e9/m/_layout/lg0/t32b8-ab".encode(),  # shaped like a manifest key
                "\u00e9/m/replicated/lg0/t32b8-ab/00".encode(),  # shaped like a page key
            )
        ],
    )


def test_non_ascii_and_undecodable_keys_of_other_programs_never_fail_inspect(capsys, tmp_path):
    store = tmp_path / "store"
    write_minimax_store(store)
    before = inspect_json(capsys, store)
    _write_foreign_keys(store)
    assert inspect_json(capsys, store) == before  # LMDB does not list them
    only = inspect_json(capsys, store, "--prefix", "\u00e9")
    assert (only["keys"], only["models"]) == (0, [])


def test_keys_outside_kvconns_alphabet_are_other_keys_never_pages_or_manifests():
    """For a backend that lists such keys: a non-ASCII key shaped like a manifest was
    read with a get that refused it, failing the whole inspect."""
    entries = [
        ("\u00e9/m/_layout/lg0/t32b8-ab", 5),
        ("\u00e9/m/replicated/lg0/t32b8-ab/00", 5),
        ("kvconn/m/replicated/lg0/t32b8-ab/00", 8),
    ]
    fp = footprint(entries)
    assert (fp.other_keys, fp.other_bytes, fp.manifests) == (2, 10, {})
    assert [model for (_, model, *_) in fp.rows] == ["m"]


@pytest.mark.parametrize(
    ("terminal", "shown"),
    [
        ({"PYTHONIOENCODING": "utf-8"}, "mod\u00e8le"),
        ({"PYTHONIOENCODING": "ascii"}, "mod\\xe8le"),
        # the C locale without UTF-8 mode: argv's "\u00e9" arrives as surrogate escapes
        ({"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}, "mod\\xe8le"),
    ],
    ids=["utf-8", "ascii", "c-locale"],
)
def test_inspect_prints_non_ascii_names_on_any_terminal(tmp_path, terminal, shown):
    """An ASCII terminal gets escapes instead of a UnicodeEncodeError traceback."""
    import subprocess
    import sys

    store = tmp_path / "store"
    backend = load_backend("lmdb", {"path": str(store)})
    try:
        for conn in tp_group(minimax_m3(tp_size=2, layers=1), backend, model="mod\u00e8le"):
            assert conn.save(HASHES[:2], [0, 1]).dropped == 0
    finally:
        backend.close()
    _write_foreign_keys(store)
    env = {**os.environ, **terminal}
    for extra in ([], ["--prefix", "\u00e9"], ["--json", "--prefix", "\u00e9"]):
        done = subprocess.run(
            [sys.executable, "-m", "kvconn.tools.cli", "inspect", "--path", str(store), *extra],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        if not extra:  # the plain report names the model
            assert f"kvconn/{shown}:" in done.stdout


def test_a_backend_that_cannot_list_gets_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(kvconn.tools.inspect_store, "backend_class", lambda name: DictBackend)
    monkeypatch.setattr(kvconn.tools.inspect_store, "_listing_backends", lambda: ["lmdb", "redis"])
    assert main(["inspect", "--backend", "dict"]) == 2
    err = capsys.readouterr().err
    assert "'dict' backend cannot list its keys" in err
    assert "backends that can: lmdb, redis" in err


# ---------------------------------------------------------------- roles, from manifests
def write_minimax_store(path: Path) -> None:
    """MiniMax-M3 at TP=8, 2 layers, N blocks saved by all 8 ranks into a real LMDB."""
    backend = load_backend("lmdb", {"path": str(path)})
    try:
        for conn in tp_group(minimax_m3(tp_size=8, layers=2), backend, model="minimax-m3"):
            assert conn.save(HASHES, list(range(N))).dropped == 0
    finally:
        backend.close()


def rewrite(path: Path, edit) -> None:
    """Apply ``edit(txn)`` to the LMDB store directly, as another tool or an old kvconn would."""
    env = lmdb.open(str(path), subdir=True)
    try:
        with env.begin(write=True) as txn:
            edit(txn)
    finally:
        env.close()


def manifest_items(txn) -> list[tuple[bytes, bytes]]:
    return [(k, bytes(v)) for k, v in txn.cursor() if parse_manifest_key(k.decode())]


def inspect_json(capsys, path: Path, *extra: str) -> dict[str, Any]:
    assert main(["inspect", "--path", str(path), "--json", *extra]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_inspect_reports_bytes_per_role_for_minimax_m3(capsys, tmp_path):
    store = tmp_path / "store"
    write_minimax_store(store)
    per_page = 2 * 256 * 32  # each role: 2 layers x 256 B/token x 32 tokens in one page
    k = N * 8 * per_page  # 8 head shards, one page each per block: 786,432 B
    index_k = N * per_page  # replicated: one page per block, stored once: 98,304 B

    result = inspect_json(capsys, store)
    (model,) = result["models"]
    assert model["role_bytes"] == {"index_k": index_k, "k": k, "v": k}
    assert k == 8 * index_k  # index-K is 1/8th of K (and of V), 1/17th of the total
    assert model["unknown_role_bytes"] == 0
    # each value is its page and an 8-byte xxh3-64 checksum: 9 pages per block
    assert model["payload_bytes"] == 2 * k + index_k == 1_671_168
    assert model["checksum_bytes"] == N * 9 * 8
    assert model["bytes"] == model["payload_bytes"] + model["checksum_bytes"]
    classes = {c["shard_class"]: c for c in model["classes"]}
    assert classes["w8"]["manifest"] == classes["replicated"]["manifest"] == "ok"
    assert classes["w8"]["checksum"] == "xxh3-64"
    assert classes["w8"]["value_bytes"] == classes["w8"]["page_bytes"] + 8 == 2 * per_page + 8
    assert classes["w8"]["size_mismatches"] == classes["replicated"]["size_mismatches"] == 0
    assert classes["w8"]["roles"] == {
        "k": {"bytes_per_page": per_page, "bytes": k},
        "v": {"bytes_per_page": per_page, "bytes": k},
    }
    assert classes["replicated"]["roles"] == {
        "index_k": {"bytes_per_page": per_page, "bytes": index_k}
    }
    # the manifests are metadata: counted as keys of the store, never as page bytes
    manifest_bytes = sum(
        len(p.manifest.to_json()) for p in plan_pages(minimax_m3(tp_size=8, layers=2))
    )
    assert (model["manifest_keys"], model["manifest_bytes"]) == (2, manifest_bytes)
    assert (result["manifest_keys"], result["manifest_bytes"]) == (2, manifest_bytes)
    assert result["keys"] == model["pages"] + 2 and result["other_keys"] == 0
    assert result["bytes"] == model["bytes"] + manifest_bytes

    # a prefix that leaves the manifests out still gets the roles, without counting them
    shard0 = inspect_json(capsys, store, "--prefix", "kvconn/minimax-m3/w8r0/")
    (model,) = shard0["models"]
    assert model["role_bytes"] == {"k": N * per_page, "v": N * per_page}
    assert model["manifest_keys"] == 0 and shard0["keys"] == N

    assert main(["inspect", "--path", str(store)]) == 0
    text = capsys.readouterr().out
    assert "by role: index_k 96.00 KiB (5.9%), k 768.00 KiB (47.1%), v 768.00 KiB (47.1%)" in text
    assert "k 768.00 KiB, v 768.00 KiB" in text  # the w8 row
    assert "2 layout manifest(s)" in text and "not counted as page bytes" in text
    assert "page payload 1.59 MiB, checksum trailers 432 B" in text


def test_values_whose_size_is_not_the_page_and_its_checksum_are_reported(capsys, tmp_path):
    store = tmp_path / "store"
    write_minimax_store(store)

    def damage(txn):
        pages = [k for k, _ in txn.cursor() if b"/replicated/" in k]
        txn.put(pages[0], bytes(txn.get(pages[0]))[:-3])  # truncated
        txn.put(pages[1], bytes(txn.get(pages[1]))[:-8])  # the bare page, no trailer

    rewrite(store, damage)
    (model,) = inspect_json(capsys, store)["models"]
    classes = {c["shard_class"]: c for c in model["classes"]}
    assert classes["replicated"]["size_mismatches"] == 2
    assert classes["w8"]["size_mismatches"] == 0
    assert main(["inspect", "--path", str(store)]) == 0
    text = capsys.readouterr().out
    assert "2 value(s) whose size is not 16392 bytes (16384 + xxh3-64 checksum)" in text


def test_without_a_manifest_only_sizes_no_checksum_scheme_gives_are_reported():
    prefix = key_prefix("kvconn", "m")
    sizes = {"00": 40, "01": 48, "02": 45}  # a bare page, one with an xxh3-64 trailer, neither
    entries = [
        (page_key(prefix, "replicated", 0, "t32b40-bb", bytes.fromhex(h) * 16), size)
        for h, size in sizes.items()
    ]
    (model,) = footprint(entries).as_dict()["models"]
    (row,) = model["classes"]
    assert (row["size_mismatches"], row["checksum"], row["value_bytes"]) == (1, None, None)
    assert (model["payload_bytes"], model["bytes"]) == (120, 133)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        # self-consistent, but says index-K is fp8: not what these pages' key hashes
        (lambda doc: doc["roles"]["index_k"].update(dtype="fp8_e4m3"), "hashes to"),
        (lambda doc: doc.update(page_size=doc["page_size"] + 1), "page_size"),
        (lambda doc: doc["regions"].pop(), "page_size 16384, the page description gives 8192"),
        (lambda doc: "not json {", "not JSON"),
    ],
    ids=["other-meaning", "wrong-page-size", "missing-region", "not-json"],
)
def test_a_manifest_whose_json_does_not_match_its_fingerprint_is_flagged(
    capsys, tmp_path, edit, problem
):
    store = tmp_path / "store"
    write_minimax_store(store)

    def corrupt(txn):
        (key, value), *_ = [
            (k, v) for k, v in manifest_items(txn) if json.loads(v)["shard_class"] == "replicated"
        ]
        doc = json.loads(value)
        changed = edit(doc)
        txn.put(key, (changed if isinstance(changed, str) else json.dumps(doc)).encode())

    rewrite(store, corrupt)
    result = inspect_json(capsys, store)
    (model,) = result["models"]
    classes = {c["shard_class"]: c for c in model["classes"]}
    bad = classes["replicated"]
    assert bad["manifest"] == "invalid" and bad["roles"] is None
    assert problem in bad["manifest_problem"]
    assert model["unknown_role_bytes"] == bad["payload_bytes"]  # its bytes are not guessed
    assert "index_k" not in model["role_bytes"]
    assert classes["w8"]["manifest"] == "ok"  # the other page kind is unaffected
    (flagged,) = model["invalid_manifests"]
    assert flagged["fingerprint"] == bad["fingerprint"] and problem in flagged["problem"]

    assert main(["inspect", "--path", str(store)]) == 0
    text = capsys.readouterr().out
    assert "unknown (invalid manifest)" in text and "invalid layout manifest" in text


def test_a_store_without_manifests_still_reports_its_pages_as_unknown_roles(capsys, tmp_path):
    store = tmp_path / "store"
    write_minimax_store(store)
    before = inspect_json(capsys, store)

    def drop_manifests(txn):  # a store written before manifests existed
        for key, _ in manifest_items(txn):
            txn.delete(key)

    rewrite(store, drop_manifests)
    result = inspect_json(capsys, store)
    (model,) = result["models"]
    (had,) = before["models"]
    assert (model["pages"], model["bytes"]) == (had["pages"], had["bytes"])
    assert model["role_bytes"] == {} and model["unknown_role_bytes"] == model["payload_bytes"]
    # without a manifest the scheme is unknown, but page + 8-byte trailer is a size it gives
    assert all(c["size_mismatches"] == 0 and c["checksum"] is None for c in model["classes"])
    assert {c["manifest"] for c in model["classes"]} == {"missing"}
    assert all(c["roles"] is None for c in model["classes"])
    assert model["manifest_keys"] == 0 and model["invalid_manifests"] == []

    assert main(["inspect", "--path", str(store)]) == 0
    text = capsys.readouterr().out
    assert "unknown roles 1.59 MiB (100.0%)" in text and "unknown (no manifest)" in text


def test_manifest_keys_and_page_keys_are_never_taken_for_each_other():
    prefix = key_prefix("ns", "Org/Model-FP8 v2")
    mkey = manifest_key(prefix, 1, "t32b16384-abcdef")
    assert mkey == "ns/Org%2FModel-FP8%20v2/_layout/lg1/t32b16384-abcdef"
    assert parse_key(mkey) is None
    parsed = parse_manifest_key(mkey)
    assert parsed is not None
    assert (parsed.namespace, parsed.model, parsed.group) == ("ns", "Org/Model-FP8 v2", 1)
    assert parsed.fingerprint == "t32b16384-abcdef"
    for component in ("replicated", "w8r0"):
        assert parse_manifest_key(page_key(prefix, component, 1, "t32b16384-abcdef", HASH)) is None
    for lookalike in (
        "ns/m/_layout/lg1/t32b8-ab/00",  # six segments: neither
        "ns/m/_layouts/lg1/t32b8-ab",
        "ns/m/_layout/g1/t32b8-ab",
        "ns/m/_layout/lg1/32b8-ab",
        "/m/_layout/lg1/t32b8-ab",
    ):
        assert parse_key(lookalike) is None and parse_manifest_key(lookalike) is None
    # a manifest in a listing is metadata: neither a page nor an "other" key
    fp = footprint([(mkey, 300)])
    assert (fp.rows, fp.other_keys) == ({}, 0)
    assert fp.as_dict()["manifest_keys"] == 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 8])
def test_a_manifest_reads_back_into_the_page_kind_it_describes(preset, tp):
    for plan in plan_pages(PRESETS[preset].layout(tp_size=tp, layers=3)):
        value = plan.manifest.to_json()
        back = PageManifest.from_json(value)
        assert back == plan.manifest and back.fingerprint == plan.fingerprint
        doc = json.loads(value)
        assert doc["page_size"] == plan.page_size
        assert doc["shard_class"] == plan.shard_class.label
        assert {n: r["bytes_per_page"] for n, r in doc["roles"].items()} == dict(plan.role_bytes)


def test_fingerprints_of_existing_stores_do_not_change():
    # Pages already stored are found only under the same fingerprint: an accidental change
    # orphans every store. Layout version 1 (no checksums) had t32b32768-6a45e8410a9d and
    # t32b16384-251df671913d; version 2 names the checksum scheme, so each has its own.
    layout = minimax_m3(tp_size=8, layers=2)
    assert [p.fingerprint for p in plan_pages(layout)] == [
        "t32b32768-8ef60c34abfa",
        "t32b16384-755d177bf48b",
    ]
    assert [p.fingerprint for p in plan_pages(layout, "none")] == [
        "t32b32768-f3aab900d22d",
        "t32b16384-6b6f5213c3af",
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=3), "version 3"),
        (lambda d: d.update(version=1), "layout version 1, written by a kvconn without page"),
        (lambda d: d.update(checksum="crc32"), "checksum 'crc32' is not one of"),
        (lambda d: d.update(checksum=["xxh3-64"]), "checksum ['xxh3-64'] is not one of"),
        (lambda d: d.update(value_size=d["page_size"]), "value_size"),
        (lambda d: d.update(num_shards=4), "num_shards"),
        (lambda d: d.update(shard_class="replicated", num_shards=1), "units 1"),
        (lambda d: d.update(extra=1), "unknown ['extra']"),
        (lambda d: d["roles"]["k"].update(units=True), "k.units"),
        (lambda d: d["regions"].append([0, "latent", 4]), "declared role"),
        (lambda d: d["regions"].append([0, ["k"], 4]), "declared role"),
        (lambda d: d.update(num_shards=True), "num_shards must be an integer"),
        (
            lambda d: d["roles"].update(q={"units": 8, "dtype": "bf16", "bytes_per_page": 0}),
            "have no region",
        ),
    ],
)
def test_an_inconsistent_manifest_is_refused_with_the_reason(edit, message):
    plan = plan_pages(minimax_m3(tp_size=8, layers=1))[0]
    doc = json.loads(plan.manifest.to_json())
    edit(doc)
    with pytest.raises(ManifestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PageManifest.from_json(json.dumps(doc))


# ------------------------------------------------ a prefix as typed (issue 15)
@pytest.mark.server
def test_inspect_of_redis_finds_a_non_ascii_model_by_the_prefix_as_typed(capsys):
    """``--prefix é`` died in the Redis backend's scan with a UnicodeEncodeError; the
    prefix is now spelt as keys spell names, so the model's own name finds its pages."""
    from kvconn.testing.suite import require_or_skip
    from kvconn.tools.devserver.redis import RedisServer

    require_or_skip(RedisServer.available())
    with RedisServer() as server:
        backend = load_backend("redis", server.options)
        try:
            for conn in tp_group(minimax_m3(tp_size=2, layers=1), backend, model="mod\u00e8le"):
                assert conn.save(HASHES[:2], [0, 1]).dropped == 0
        finally:
            backend.close()
        store = ["--backend", "redis", "-o", f"url={server.url}", "--json"]
        for typed, pages in (("kvconn/mod\u00e8le/", 6), ("kvconn/mod\u00e8", 6), ("\u00e9", 0)):
            assert main(["inspect", *store, "--prefix", typed]) == 0, capsys.readouterr().err
            result = json.loads(capsys.readouterr().out)
            assert sum(m["pages"] for m in result["models"]) == pages, typed
        assert result["prefix"] == "%C3%A9"
        # an escaped prefix copied from a key is taken as written
        assert main(["inspect", *store, "--prefix", "kvconn/mod%C3%A8le/"]) == 0
        assert [m["model"] for m in json.loads(capsys.readouterr().out)["models"]] == [
            "mod\u00e8le"
        ]
