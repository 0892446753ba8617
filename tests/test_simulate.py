"""`kvconn simulate`: real model geometry over TP rank processes on an LMDB store.

The runs are small (1 layer, a few short conversations) so the file stays fast on two
cores; the savings do not depend on the layer count or the workload size, only on the
bytes per token of each role, which are the presets' real ones.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from kvconn.errors import ConfigError, LayoutError
from kvconn.plan import plan_pages
from kvconn.tools.cli import main
from kvconn.tools.models import PRESETS, get_preset, load_preset, minimax_m3
from kvconn.tools.simulate.report import format_report
from kvconn.tools.simulate.synth import Synth
from kvconn.tools.simulate.workload import WorkloadSpec, generate

pytestmark = pytest.mark.slow

SMALL = [
    "--layers",
    "1",
    "--conversations",
    "4",
    "--turns",
    "3",
    "--system-prompts",
    "2",
    "--system-tokens",
    "64:160",
    "--user-tokens",
    "16:96",
    "--reply-tokens",
    "16:96",
    "--no-progress",
]


def simulate(capsys, store: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["simulate", "--path", str(store), "--json", *SMALL, *args])
    captured = capsys.readouterr()
    assert captured.out, captured.err
    return code, json.loads(captured.out)


@pytest.fixture(scope="module")
def minimax_run(tmp_path_factory):
    """One minimax-m3 run at TP=8, shared by the tests that only read its report."""
    store = tmp_path_factory.mktemp("minimax") / "store"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # capsys is per test; this run is per module
        code = main(["simulate", "--path", str(store), "--json", *SMALL])
    return code, json.loads(out.getvalue())


# ---------------------------------------------------------------- savings at TP=8
def test_minimax_m3_stores_29_2_percent_less_than_per_rank_keying(minimax_run):
    code, report = minimax_run
    assert code == 0
    assert (report["model"], report["tp"], report["backend"]) == ("minimax-m3", 8, "lmdb")
    assert report["saving"] == pytest.approx(1 - (8 * 512 + 256) / (8 * 768))
    assert round(report["saving"], 3) == 0.292
    assert report["saving_rank0_scheme"] == pytest.approx(report["saving"])  # index-K: both once
    assert report["payload_bytes_stored"] == sum(report["bytes_written_by_rank"])
    # each stored value ends in its page's 8-byte xxh3-64 checksum
    assert report["checksum"] == "xxh3-64"
    assert report["bytes_stored"] == report["payload_bytes_stored"] + 8 * report["pages_written"]


def test_the_json_report_has_every_documented_key(minimax_run):
    _, report = minimax_run
    required = {
        "model",
        "tp",
        "backend",
        "requests",
        "prompt_tokens",
        "hit_tokens",
        "bytes_written_by_rank",
        "bytes_stored",
        "bytes_naive",
        "saving",
        "saving_rank0_scheme",
        "write_balance",
        "pages_loaded",
        "pages_verified",
        "errors",
        "striped",
        "bytes_read_by_rank",
        "bytes_received_by_rank",
        "bytes_read",
        "bytes_read_unstriped",
        "read_saving",
    }
    assert required <= set(report)
    assert len(report["bytes_written_by_rank"]) == 8


def test_every_loaded_page_is_verified_and_none_differs(minimax_run):
    _, report = minimax_run
    assert report["hit_tokens"] > 0  # shared system prompts and earlier turns hit
    assert report["pages_verified"] == report["pages_loaded"] > 0
    assert report["errors"] == 0 and report["error_examples"] == []


@pytest.mark.parametrize(
    ("model", "saving", "reference"),
    [
        ("qwen3-235b-a22b", 0.5, 0.0),  # 4 KV heads at TP=8: pairs of ranks share a head
        ("deepseek-v3.2", 0.875, 1 - (8 * 656 + 132) / (8 * 788)),  # latent + indexer once
        ("llama-3.1-70b", 0.0, 0.0),  # one KV head per rank: nothing to share
    ],
)
def test_each_preset_saves_what_its_replicated_bytes_allow(
    capsys, tmp_path, model, saving, reference
):
    code, report = simulate(capsys, tmp_path / "store", "--model", model)
    assert code == 0 and report["errors"] == 0
    assert report["saving"] == pytest.approx(saving, abs=1e-9)
    assert report["saving_rank0_scheme"] == pytest.approx(reference, abs=1e-9)
    if model == "deepseek-v3.2":
        assert round(report["saving_rank0_scheme"], 3) == 0.147


# ---------------------------------------------------------------- reuse across runs
def test_a_second_run_on_the_same_store_hits_what_the_first_stored(capsys, tmp_path):
    store = tmp_path / "store"
    _, first = simulate(capsys, store)
    _, second = simulate(capsys, store)
    assert second["prompt_tokens"] == first["prompt_tokens"]  # the seed replays the workload
    assert second["hit_tokens"] > first["hit_tokens"]
    # every full block except each prompt's last token was stored by the first run
    assert second["bytes_stored"] == 0
    assert second["saving"] is None  # nothing written: nothing to compare
    assert second["errors"] == 0 and second["pages_verified"] > first["pages_verified"]


def test_a_rerun_that_adds_nothing_reports_what_the_store_holds_for_the_model(capsys, tmp_path):
    """Issue 15: the second run's "0 bytes stored" read as a broken run. It is what the
    run *added*; the report also says what the store holds for the model."""
    from kvconn.tools.simulate.report import format_report

    store = tmp_path / "store"
    _, first = simulate(capsys, store)
    _, second = simulate(capsys, store)
    assert first["bytes_in_store"] == first["bytes_stored"] > 0
    assert first["pages_in_store"] == first["pages_written"]
    assert second["bytes_stored"] == 0
    assert (second["bytes_in_store"], second["pages_in_store"]) == (
        first["bytes_stored"],
        first["pages_written"],
    )
    assert second["store_prefix"] == "kvconn/minimax-m3/"
    assert main(["inspect", "--path", str(store), "--json"]) == 0  # the same figure
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert (model["pages"], model["bytes"]) == (second["pages_in_store"], second["bytes_in_store"])
    table = format_report(second)
    assert "  stored by this run             0 B   (pages 0 B" in table
    assert f"{second['pages_in_store']:,} pages under kvconn/minimax-m3/" in table


# ---------------------------------------------------------------- across TP sizes
def test_with_shard_heads_a_tp4_run_loads_and_verifies_what_a_tp8_run_stored(capsys, tmp_path):
    """8 KV heads written at TP=8 and read at TP=4: with shard_heads = 8 each TP=4 rank
    loads two head shards per block and has nothing left to store; without it, a clean
    miss (the TP=4 run hits only what it stores itself)."""
    store = tmp_path / "store"
    llama = ("--model", "llama-3.1-70b")
    _, written = simulate(capsys, store, *llama, "--tp", "8", "--shard-heads", "8")
    code, read = simulate(capsys, store, *llama, "--tp", "4", "--shard-heads", "8")
    assert code == 0 and read["errors"] == 0 and read["shard_heads"] == 8
    assert read["hit_tokens"] > written["hit_tokens"]
    assert read["pages_verified"] == read["pages_loaded"] > 0
    assert read["bytes_stored"] == 0  # every page it would write was stored at TP=8
    assert "K/V pages cut at 8 head shards" in format_report(read)
    _, alone = simulate(capsys, store, *llama, "--tp", "4")
    assert alone["hit_tokens"] == written["hit_tokens"]  # the workload's own reuse only
    assert alone["payload_bytes_stored"] == written["payload_bytes_stored"]


def test_with_shard_heads_a_tp8_run_loads_and_verifies_what_a_tp4_run_stored(capsys, tmp_path):
    store = tmp_path / "store"
    _, written = simulate(capsys, store, "--tp", "4", "--shard-heads", "8")
    code, read = simulate(capsys, store, "--tp", "8", "--shard-heads", "8")
    assert code == 0 and read["errors"] == 0
    assert read["hit_tokens"] > written["hit_tokens"] and read["bytes_stored"] == 0
    assert read["pages_verified"] == read["pages_loaded"] > 0
    # MiniMax-M3's index-K is replicated: read once per TP=8 group, as at any TP
    assert read["bytes_read"] == read["bytes_read_unstriped"] * (512 + 256 / 8) // 768


def test_synthetic_head_shards_agree_across_tp_sizes():
    """A TP=4 rank's bytes of a region are TP=8 ranks 2j's and 2j+1's, one after the
    other, when pages are cut at 8 head shards: the bytes real ranks would hold."""
    hashes = [bytes([i]) * 16 for i in range(3)]
    at8 = minimax_m3(tp_size=8, layers=1)
    at4 = minimax_m3(tp_size=4, layers=1)
    for r8, r4 in zip(at8.groups[0].regions, at4.groups[0].regions):
        halves = [Synth(at8, rank, "m", 8).region_bytes(hashes, r8) for rank in (2, 3)]
        whole = Synth(at4, 1, "m", 8).region_bytes(hashes, r4)
        if r4.role == "index_k":
            assert torch.equal(whole, halves[0])
        else:
            assert torch.equal(whole, torch.cat(halves, dim=1))


# ---------------------------------------------------------------- striped reads
def test_striped_ranks_read_each_deepseek_page_once_per_group_an_eighth_of_unstriped(
    capsys, tmp_path
):
    store = tmp_path / "store"
    simulate(capsys, store, "--model", "deepseek-v3.2")
    code, striped = simulate(capsys, store, "--model", "deepseek-v3.2")
    _, alone = simulate(capsys, store, "--model", "deepseek-v3.2", "--no-stripe")
    assert code == 0 and striped["errors"] == alone["errors"] == 0
    assert striped["striped"] and not alone["striped"]
    assert striped["bytes_loaded"] == alone["bytes_loaded"] > 0  # the same warm loads
    # every byte loaded came from the store once for the group, from the group otherwise
    assert striped["bytes_read"] * 8 == alone["bytes_read"] == striped["bytes_read_unstriped"]
    assert striped["read_saving"] == pytest.approx(0.875)
    assert alone["bytes_read_by_rank"] == [alone["bytes_read"] // 8] * 8
    assert sum(alone["bytes_received_by_rank"]) == 0
    assert "store reads saved 87.5%" in format_report(striped)


def test_striped_minimax_ranks_read_their_own_kv_and_an_eighth_of_the_index_k(capsys, tmp_path):
    store = tmp_path / "store"
    simulate(capsys, store)
    _, report = simulate(capsys, store)
    unstriped = report["bytes_read_unstriped"]
    # K/V (512 B/token per rank) read by each rank, index-K (256) once per group
    assert report["bytes_read"] == unstriped * (512 + 256 / 8) // 768
    assert report["read_saving"] == pytest.approx(1 - (512 + 32) / 768)


# ---------------------------------------------------------------- write ownership
def test_the_first_policy_puts_every_replicated_page_on_rank_zero(capsys, tmp_path):
    code, report = simulate(capsys, tmp_path / "store", "--policy", "first")
    assert code == 0
    written = report["bytes_written_by_rank"]
    assert written[0] * 512 == written[1] * 768  # rank 0: K+V+index-K, the others: K+V
    assert len(set(written[1:])) == 1
    assert report["write_balance"] == pytest.approx(768 / 544)


def test_the_spread_policy_balances_bytes_written_within_5_percent_over_1000_blocks(
    capsys, tmp_path
):
    code, report = simulate(
        capsys,
        tmp_path / "store",
        "--tokens-per-block",
        "4",
        "--conversations",
        "8",
        "--system-tokens",
        "64:128",
        "--user-tokens",
        "64:256",
        "--reply-tokens",
        "64:256",
    )
    assert code == 0
    assert report["pages_written_by_role"]["index_k"] >= 1000  # one per block stored
    assert report["write_balance"] <= 1.05


# ---------------------------------------------------------------- failures
def flip_a_replicated_page(store: Path) -> bytes:
    """Flip byte 100 of one stored replicated page in place (same size); its key."""
    env = lmdb.open(str(store), subdir=True)
    try:
        with env.begin(write=True) as txn:
            key, value = next((k, v) for k, v in txn.cursor() if b"/replicated/" in k)
            flipped = bytearray(value)
            flipped[100] ^= 0xFF
            txn.put(key, bytes(flipped))
    finally:
        env.close()
    return bytes(key)


def test_a_flipped_byte_in_a_stored_page_fails_its_checksum_and_the_page_is_rewritten(
    capsys, tmp_path
):
    store = tmp_path / "store"
    code, _ = simulate(capsys, store)
    assert code == 0
    flip_a_replicated_page(store)
    code, report = simulate(capsys, store)
    # every rank loads the replicated page: each finds it bad, one deletes it
    assert code == 0 and report["errors"] == 0  # no wrong byte reached a pool
    assert report["pages_corrupt"] >= 1 and report["pages_repaired"] == 1
    assert report["blocks_recomputed_after_failed_load"] >= 1
    assert report["pages_written"] >= 1  # the recomputed block's pages were stored again
    code, third = simulate(capsys, store)
    assert code == 0 and third["pages_corrupt"] == 0 and third["pages_written"] == 0
    assert third["blocks_recomputed_after_failed_load"] == 0
    assert third["hit_tokens"] == third["lookup_hit_tokens"] > report["hit_tokens"]


def test_without_checksums_a_flipped_byte_reaches_the_pool(capsys, tmp_path):
    # What the checksum prevents: with checksum = "none" only the simulation's own
    # byte-for-byte verification sees the wrong page, after the connector loaded it.
    config = tmp_path / "kvconn.toml"
    config.write_text('checksum = "none"\n')
    store = tmp_path / "store"
    code, _ = simulate(capsys, store, "--config", str(config))
    assert code == 0
    key = flip_a_replicated_page(store)
    code, report = simulate(capsys, store, "--config", str(config))
    assert code == 1  # the run fails instead of silently serving wrong bytes
    assert report["errors"] >= 1 and report["pages_corrupt"] == 0
    assert any(key.decode() in e and "byte 100 " in e for e in report["error_examples"])


def test_a_page_evicted_after_the_lookup_makes_every_rank_recompute_its_block(capsys, tmp_path):
    store = tmp_path / "store"
    simulate(capsys, store)
    code, report = simulate(capsys, store, "--evict-rate", "1")
    assert code == 0 and report["errors"] == 0
    assert report["evictions"] > 0
    assert report["blocks_recomputed_after_failed_load"] > 0
    assert report["hit_tokens"] < report["lookup_hit_tokens"]  # the group agreed on less
    assert report["bytes_stored"] > 0  # the recomputed pages were stored again


# ---------------------------------------------------------------- custom layouts
LAYOUT_TOML = """
name = "tiny-mla"
layers = 4
sources = ["a test layout"]

[[roles]]
name = "k"
units = 2
bytes_per_unit = 256
dtype = "bf16"

[[roles]]
name = "v"
units = 2
bytes_per_unit = 256
dtype = "bf16"

[[roles]]
name = "index_k"
units = 1
bytes_per_unit = 64
dtype = "fp8"
pool = 1
reference = "once"
"""


def test_a_custom_toml_layout_runs_with_its_replicated_role_stored_once(capsys, tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(LAYOUT_TOML)
    code, report = simulate(capsys, tmp_path / "store", "--layout", str(path), "--tp", "2")
    assert code == 0 and report["errors"] == 0 and report["pages_verified"] > 0
    assert report["model"] == "tiny-mla"
    assert report["saving"] == pytest.approx(1 - (2 * 512 + 64) / (2 * 576))
    assert report["saving_rank0_scheme"] == pytest.approx(report["saving"])


def test_a_layout_file_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(LAYOUT_TOML.replace("bytes_per_unit = 64", "bytes_per_unt = 64"))
    with pytest.raises(ConfigError, match=r"unknown key.*bytes_per_unt"):
        load_preset(path)
    path.write_text(LAYOUT_TOML.replace('reference = "once"', 'reference = "twice"'))
    with pytest.raises(ConfigError, match="'per_rank' or 'once'"):
        load_preset(path)


# ---------------------------------------------------------------- replica checks
def test_an_injected_index_k_mismatch_is_found_at_the_first_save_and_no_load_differs(
    capsys, tmp_path
):
    store = tmp_path / "store"
    code, report = simulate(capsys, store, "--tp", "4", "--inject-mismatch", "index_k:1")
    assert code == 0 and report["errors"] == 0 and report["pages_verified"] > 0
    assert report["mismatch_injected"] == "index_k:1"
    assert report["replica_mismatch"] > 0 and report["replicas_verified"] == 0
    assert report["per_rank_kinds"] == ["lg0/replicated"]
    # index-K is stored per rank from the first save on: every rank's own copy
    written = report["pages_written_by_role"]
    assert written["index_k"] == written["k"]
    # a second run adopts the store's marker at start-up and hits what the first stored
    code, again = simulate(capsys, store, "--tp", "4", "--inject-mismatch", "index_k:1")
    assert code == 0 and again["errors"] == 0 and again["hit_tokens"] > 0
    assert again["per_rank_kinds"] == ["lg0/replicated"] and again["replica_mismatch"] == 0


def test_without_a_mismatch_the_first_save_verifies_and_nothing_is_keyed_per_rank(capsys, tmp_path):
    code, report = simulate(capsys, tmp_path / "store", "--tp", "4")
    assert code == 0 and report["errors"] == 0
    assert report["replicas_verified"] > 0 and report["replica_mismatch"] == 0
    assert report["per_rank_kinds"] == []
    _, off = simulate(capsys, tmp_path / "other", "--tp", "4", "--verify-replicas-every", "0")
    assert off["replicas_verified"] == 0 and off["verify_replicas_every"] == 0


# ---------------------------------------------------------------- bad options
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "gpt-5"],
            "presets: deepseek-v3.2, llama-3.1-70b, minimax-m3, qwen3-235b-a22b",
        ),
        (["--backend", "nope"], "installed backends: "),
        (["--layers", "100"], "has 60 layers; --layers must be between 1 and 60"),
        (["--model", "qwen3-235b-a22b", "--tp", "3"], "cannot run at TP=3: role 'k' has 4 units"),
        (["--option", "map_size"], "--option expects KEY=VALUE"),
        (["--option", "mapsize=1"], "unknown option(s): mapsize; known: map_size, max_map_size"),
        (["--system-tokens", "9:3"], "0 <= MIN <= MAX"),
        (["--evict-rate", "2"], "evict rate must be within [0, 1]"),
        (["--shard-heads", "4"], "shard_heads=4 is not a multiple of TP=8's 8 shards of role"),
        (["--shard-heads", "0"], "shard_heads must be a number of head shards between 1"),
        # absurd sizes (issue 11): refused before any rank process starts
        (["--tp", "100000"], "--tp must be an int between 1 and 128, got 100000"),
        (["--tokens-per-block", "100000"], "--tokens-per-block must be an int between 1 and"),
        (["--conversations", "2000000"], "conversations must be an int between 1 and 1,000,000"),
        (["--user-tokens", "1:99999999"], "user_tokens must be MIN:MAX with 0 <= MIN <= MAX <="),
        (["-o", "sync=no"], "lmdb: sync must be true or false, got 'no'"),
        (["-o", "max_readers=-1"], "lmdb: max_readers must be an int between 1 and 65536"),
        (["-o", "path=''"], "lmdb: path must be a non-empty directory path"),
        (["--inject-mismatch", "index_k"], "--inject-mismatch expects ROLE:RANK"),
        (["--inject-mismatch", "latent:1"], "has no role 'latent'; its roles: k, v, index_k"),
        (["--inject-mismatch", "index_k:8"], "rank 8 is not a rank of TP=8"),
        (["--verify-replicas-every", "-1"], "verify_replicas_every must be an int between 0"),
    ],
)
def test_bad_options_fail_fast_with_a_clear_message(capsys, tmp_path, args, message):
    path = [] if any(a.startswith("path=") for a in args) else ["--path", str(tmp_path / "s")]
    code = main(["simulate", *path, *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_run_that_cannot_fit_in_memory_is_refused_with_its_size_before_starting(
    capsys, tmp_path, monkeypatch
):
    """``--tp 64`` with the real layer count used to start the ranks and die in one of
    them with an out-of-memory traceback; now the estimate is checked first."""
    import kvconn.tools.simulate.runner as runner

    monkeypatch.setattr(runner, "available_memory", lambda: 3 << 30)
    store = tmp_path / "store"
    args = ["--model", "deepseek-v3.2", "--tp", "64", "--layers", "all"]
    assert main(["simulate", "--path", str(store), *SMALL[2:], *args]) == 2
    err = capsys.readouterr().err
    assert "this simulation needs about" in err and "64 rank(s) x (pools" in err
    assert "but the machine has 3.00 GiB available; lower --tp" in err
    assert not store.exists()  # nothing started: not even the store was opened


def test_the_memory_estimate_counts_every_ranks_pools_and_staging():
    from kvconn.tools.simulate.budget import (
        BASE_OVERHEAD,
        BYTES_PER_WORKLOAD_TOKEN,
        RANK_OVERHEAD,
        check_memory,
        estimate_memory,
    )

    estimate = estimate_memory(
        ranks=8,
        pool_sizes=(64 << 20, 16 << 20),
        staging_bytes=256 << 20,
        prompt_tokens=1000,
        start_method="spawn",
    )
    per_rank = (80 << 20) + (40 << 20) + 4096 + RANK_OVERHEAD["spawn"]  # staging: half a pool
    expected = 8 * per_rank + 1000 * BYTES_PER_WORKLOAD_TOKEN + BASE_OVERHEAD
    assert estimate.total == expected
    check_memory(estimate, expected)  # fits exactly
    check_memory(estimate, None)  # unknown: not refused
    with pytest.raises(ConfigError, match=r"8 rank\(s\) x \(pools 80.00 MiB \+ staging"):
        check_memory(estimate, expected - 1)


@pytest.mark.parametrize("seed", range(5))
def test_the_workloads_token_bound_known_before_generating_it_holds(seed):
    spec = WorkloadSpec(seed=seed, conversations=6, turns=5, system_tokens=(0, 90))
    assert 0 < sum(len(r.tokens) for r in generate(spec)) <= spec.max_prompt_tokens()


def test_a_layout_file_with_absurd_sizes_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text(LAYOUT_TOML.replace("bytes_per_unit = 64", "bytes_per_unit = 999999999"))
    with pytest.raises(LayoutError, match="bytes_per_unit must be an int between 1 and 1048576"):
        load_preset(path)
    path.write_text(LAYOUT_TOML.replace("layers = ", "layers = 1000000 #"))
    with pytest.raises(LayoutError, match="layers must be an int between 1 and 10000"):
        load_preset(path)


def test_simulate_never_prints_a_password_from_options_or_urls(tmp_path, monkeypatch):
    """Secrets through the environment (the way to keep them out of argv) and in a URL;
    the store is unreachable, so warnings and the report's error figures are shown."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens
    env = {**os.environ, "KVCONN_OPTION_PASSWORD": "hunter2-env"}
    url = f"url=redis://alice:hunter2-url@127.0.0.1:{port}/0"
    command = ["simulate", "--tp", "2", *SMALL, "--backend", "redis", "-o", url]
    # One process (its rank processes' output included) runs the report and the JSON
    # report, the command line's own main() each time, and exits with the worse code.
    code = (
        "import sys\n"
        "from kvconn.tools.cli import main\n"
        f"sys.exit(max(main({command!r}), main({[*command, '--json']!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert '"saving"' in done.stdout and "saving" in done.stdout.split("{", 1)[0]
    assert "hunter2" not in done.stdout + done.stderr
    from kvconn.config import ConnectorConfig
    from kvconn.tools.simulate.runner import SimSettings

    config = ConnectorConfig(model="m", backend="redis", options={"password": "hunter2"})
    assert "hunter2" not in repr(SimSettings(get_preset("minimax-m3"), config))


# ---------------------------------------------------------------- presets and bytes
def test_presets_have_the_real_per_rank_bytes_at_tp8():
    per_rank = {
        name: {r.name: r.bytes_per_token for r in preset.role_specs(8)}
        for name, preset in PRESETS.items()
    }
    assert per_rank == {
        "minimax-m3": {"k": 256, "v": 256, "index_k": 256},
        "deepseek-v3.2": {"latent": 512 + 16 + 128, "index_k": 128 + 4},
        "qwen3-235b-a22b": {"k": 256, "v": 256},
        "llama-3.1-70b": {"k": 256, "v": 256},
    }
    assert {n: p.layers for n, p in PRESETS.items()} == {
        "minimax-m3": 60,
        "deepseek-v3.2": 61,
        "qwen3-235b-a22b": 94,
        "llama-3.1-70b": 80,
    }
    assert {r.name: r.bytes_per_token for r in get_preset("llama-3.1-70b").role_specs(2)} == {
        "k": 1024,
        "v": 1024,
    }


def test_minimax_index_k_interleaves_with_k_and_v_inside_each_slot():
    layout = get_preset("minimax-m3").layout(tp_size=8, layers=2, num_slots=4)
    regions = [(r.role, r.layer, r.base, r.pool) for r in layout.groups[0].regions]
    size = 256 * 32
    assert regions == [
        ("k", 0, 0, 0),
        ("v", 0, size, 0),
        ("index_k", 0, 2 * size, 0),
        ("k", 1, 3 * size, 0),
        ("v", 1, 4 * size, 0),
        ("index_k", 1, 5 * size, 0),
    ]
    assert [p.shard_class.label for p in plan_pages(layout)] == ["w8", "replicated"]
    assert layout == minimax_m3(tp_size=8, layers=2, num_slots=4)


def test_deepseek_keeps_its_indexer_in_a_pool_of_its_own():
    layout = get_preset("deepseek-v3.2").layout(tp_size=8, layers=3, num_slots=4)
    assert layout.pool_sizes == (3 * 656 * 32 * 4, 3 * 132 * 32 * 4)
    (page,) = plan_pages(layout)
    assert page.shard_class.replicated and page.page_size == 3 * (656 + 132) * 32


def test_synthetic_bytes_agree_across_replicas_and_differ_across_shards():
    layout = get_preset("qwen3-235b-a22b").layout(tp_size=8, layers=1, num_slots=4)
    hashes = [bytes([i]) * 16 for i in range(3)]
    region = layout.groups[0].regions[0]
    by_rank = [Synth(layout, rank, "m").region_bytes(hashes, region) for rank in range(8)]
    assert bytes(by_rank[0].flatten().tolist()) == bytes(by_rank[1].flatten().tolist())
    assert not bool((by_rank[1] == by_rank[2]).all())
    assert not bool((by_rank[0][0] == by_rank[0][1]).all())  # blocks differ
    mla = get_preset("deepseek-v3.2").layout(tp_size=8, layers=1, num_slots=4)
    latent = mla.groups[0].regions[0]
    first = Synth(mla, 0, "m").region_bytes(hashes, latent)
    assert all(
        bool((Synth(mla, r, "m").region_bytes(hashes, latent) == first).all()) for r in (3, 7)
    )


def test_the_workload_is_seed_stable_and_later_turns_extend_earlier_prompts():
    spec = WorkloadSpec(seed=7, conversations=5, turns=3)
    requests = generate(spec)
    assert requests == generate(spec)
    assert requests != generate(WorkloadSpec(seed=8, conversations=5, turns=3))
    last: dict[int, tuple[int, ...]] = {}
    for req in requests:
        if req.conversation in last:
            assert req.tokens[: len(last[req.conversation])] == last[req.conversation]
        last[req.conversation] = req.tokens
    starts = {r.tokens[:64] for r in requests if r.turn == 0}
    assert len(starts) <= spec.system_prompts  # shared system prompts repeat


def test_a_preset_refuses_a_tp_size_its_heads_cannot_split_over():
    with pytest.raises(LayoutError, match="cannot run at TP=3: role 'k' has 4 units"):
        get_preset("qwen3-235b-a22b").layout(tp_size=3)


def test_a_rank_that_fails_to_start_stops_the_run_with_its_error():
    from kvconn.config import ConnectorConfig
    from kvconn.tools.simulate.runner import SimulationError, _Group
    from kvconn.tools.simulate.worker import RankSpec

    config = ConnectorConfig(model="m", backend="lmdb", options={"path": "/nonexistent/\0bad"})
    spec = RankSpec(0, get_preset("llama-3.1-70b"), 8, 1, 4, 32, config)
    with pytest.raises(SimulationError, match="rank 0 failed: "):
        _Group([spec], "forkserver")
