import json
import subprocess
import sys

import pytest

from kvconn.errors import ConfigError
from kvconn.tools.cli import main


def test_help_names_every_subcommand_and_the_purpose(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "stores bytes identical across tensor-parallel" in out
    assert "backends" in out


def test_backends_lists_each_installed_backend_with_its_distribution_and_status(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("lmdb"))
    assert line.split()[1:] == ["kvconn", "ok"]


def test_backends_json_is_machine_readable(capsys):
    assert main(["backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["lmdb"]["problem"] is None


def test_no_subcommand_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: kvconn" in capsys.readouterr().out


def test_help_and_the_torch_free_modules_never_import_torch():
    """Only the connector, data movement and staging need torch: a backend, a lookup-only
    process and ``kvconn --help`` must not pay the seconds it takes to import."""
    modules = [
        "kvconn",
        "kvconn.layout",
        "kvconn.plan",
        "kvconn.keys",
        "kvconn.config",
        "kvconn.registry",
        "kvconn.backend",
        "kvconn.hashing",
        "kvconn.testing",
        "kvconn_lmdb",
        "kvconn_redis",
        "kvconn_mooncake",
        "kvconn.tools.cli",
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from kvconn.tools.cli import build_parser\n"
        "build_parser().format_help()\n"
        "from kvconn import KvLayout, ConnectorConfig\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_package_exports_its_public_names_lazily():
    import kvconn

    assert kvconn.Connector.__name__ == "Connector"
    assert set(kvconn.__all__) <= set(dir(kvconn))
    try:
        kvconn.NoSuchName  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.mkdir(), "is a directory, not a file"),
        (lambda p: p.write_bytes(b"\xff\xfe = 1"), "is not UTF-8 text"),
        (lambda p: p.write_text('model = "m"\noptions = 5\n'), "options must be a table/dict"),
    ],
    ids=["directory", "not-utf-8", "options-not-a-table"],
)
@pytest.mark.parametrize("command", ["inspect", "simulate"])
def test_a_config_file_that_cannot_be_used_is_one_error_line_not_a_traceback(
    capsys, tmp_path, command, write, message
):
    path = tmp_path / "kvconn.toml"
    write(path)
    assert main([command, "--config", str(path), "--path", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_error_messages_are_printed_with_url_passwords_masked(capsys, monkeypatch):
    import kvconn.tools.inspect_store

    def fail(args):
        raise ConfigError("cannot reach redis://alice:hunter2@10.0.0.1:6379/0")

    monkeypatch.setattr(kvconn.tools.inspect_store, "run", fail)
    assert main(["inspect"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "redis://alice:***@10.0.0.1:6379/0" in err
