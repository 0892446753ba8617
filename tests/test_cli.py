import json
import subprocess
import sys

from kvconn.cli import main


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvconn.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_names_every_subcommand_and_the_purpose():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "stores bytes identical across tensor-parallel" in out.stdout
    assert "backends" in out.stdout


def test_backends_lists_each_installed_backend_with_its_distribution_and_status():
    out = run_cli("backends")
    assert out.returncode == 0
    line = next(line for line in out.stdout.splitlines() if line.startswith("lmdb"))
    assert line.split()[1:] == ["kvconn", "ok"]


def test_backends_json_is_machine_readable(capsys):
    assert main(["backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["lmdb"]["problem"] is None


def test_no_subcommand_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: kvconn" in capsys.readouterr().out
