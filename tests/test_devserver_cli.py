"""``kvconn dev-server``: real servers a developer can point kvconn at, stopped by Ctrl-C,
gone when whoever started them dies, and a bad flag is one line that names it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvconn.registry import load_backend
from kvconn.testing.suite import require_or_skip
from kvconn.tools.cli import main
from kvconn.tools.devserver.mooncake import MooncakeCluster
from kvconn.tools.devserver.redis import RedisServer

pytestmark = pytest.mark.server


def start_dev_server(*args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconn.tools.cli", "dev-server", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"dev-server printed nothing: {proc.stderr.read()}")
    return proc, json.loads(line)


def stop_with_ctrl_c(proc):
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def test_dev_server_redis_prints_working_options_and_stops_on_ctrl_c():
    require_or_skip(RedisServer.available())
    proc, options = start_dev_server("redis")
    try:
        assert options["url"].startswith("redis://127.0.0.1:")
        backend = load_backend("redis", options)
        assert backend.put(["dev/k"], [b"v"]) == [True]
        assert backend.exists(["dev/k"]) == [True]
        backend.close()
    finally:
        stop_with_ctrl_c(proc)
    port = int(options["url"].rsplit(":", 1)[1].split("/")[0])
    out = subprocess.run(["pgrep", "-f", f"redis-server.*{port}"], capture_output=True)
    assert out.returncode == 1  # nothing left running


def test_dev_server_mooncake_prints_working_options_and_stops_on_ctrl_c():
    require_or_skip(MooncakeCluster.available())
    proc, options = start_dev_server("mooncake", "--segment-size", "64MiB")
    try:
        assert options["master_address"].startswith("127.0.0.1:")
    finally:
        stop_with_ctrl_c(proc)
    port = options["master_address"].rsplit(":", 1)[1]
    out = subprocess.run(["pgrep", "-f", f"mooncake_master.*{port}"], capture_output=True)
    assert out.returncode == 1


# ------------------------------------------------------------------ bad flags


@pytest.fixture(scope="module")
def busy_port():
    """A loopback port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture(scope="module")
def a_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("devserver") / "not-a-directory"
    path.write_text("")
    return path


#: (argv after ``dev-server``, what the error line must contain, server the case starts)
BAD_FLAGS = {
    "port-not-a-number": (["redis", "--port", "abc"], ["--port", "'abc'"], None),
    "port-too-large": (["redis", "--port", "70000"], ["--port", "70000"], None),
    "port-negative": (["redis", "--port", "-1"], ["--port", "-1"], None),
    "port-in-use": (["redis", "--port", "{busy_port}"], ["--port", "{busy_port}"], "redis"),
    "maxmemory-bogus": (["redis", "--maxmemory", "lots"], ["--maxmemory", "'lots'"], None),
    "policy-bogus": (
        ["redis", "--maxmemory-policy", "bogus"],
        ["--maxmemory-policy", "bogus"],
        "redis",
    ),
    "cluster-negative": (["redis", "--cluster", "-3"], ["--cluster", "-3"], None),
    "cluster-too-small": (["redis", "--cluster", "2"], ["--cluster", "'2'", "3"], None),
    "cluster-with-port": (["redis", "--cluster", "3", "--port", "7000"], ["--port", "7000"], None),
    "storage-negative": (
        ["mooncake", "--storage-processes", "-1"],
        ["--storage-processes", "-1"],
        None,
    ),
    "storage-none": (["mooncake", "--storage-processes", "0"], ["--storage-processes", "0"], None),
    "segment-tiny": (["mooncake", "--segment-size", "1MiB"], ["--segment-size", "1MiB"], None),
    "segment-bogus": (["mooncake", "--segment-size", "big"], ["--segment-size", "'big'"], None),
    "client-ttl-zero": (["mooncake", "--client-ttl", "0"], ["--client-ttl", "'0'"], None),
    "log-dir-a-file": (["mooncake", "--log-dir", "{a_file}"], ["--log-dir", "{a_file}"], None),
    "host-not-local": (["mooncake", "--host", "192.0.2.1"], ["--host", "192.0.2.1"], None),
    "master-flag-bogus": (["mooncake", "--", "--bogus_flag=1"], ["bogus_flag"], "mooncake"),
}


@pytest.mark.parametrize("case", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_a_bad_flag_is_one_error_line_naming_it_and_exit_code_2(case, busy_port, a_file, capsys):
    argv, expected, server = case
    if server == "redis":
        require_or_skip(RedisServer.available())
    if server == "mooncake":
        require_or_skip(MooncakeCluster.available())
    values = {"busy_port": busy_port, "a_file": a_file}
    code: object
    try:
        code = main(["dev-server", *(arg.format(**values) for arg in argv)])
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.splitlines()) == 1, err
    assert "error:" in err
    for fragment in expected:
        assert fragment.format(**values) in err, err
    assert out == ""


def test_a_missing_dev_server_library_names_the_extra_to_install(monkeypatch, capsys):
    for name in [m for m in sys.modules if m.startswith("kvconn.tools.devserver.")]:
        if not name.endswith(".cli"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mirakuru", None)  # import mirakuru now fails
    assert main(["dev-server", "redis"]) == 2
    err = capsys.readouterr().err
    assert "'mirakuru'" in err and "pip install 'kvconn[devserver]'" in err, err


# ------------------------------------------------------- dying with the parent

PARENT = """
import json, sys, time
from kvconn.tools.devserver.mooncake import MooncakeCluster
from kvconn.tools.devserver.redis import RedisServer

if sys.argv[1] == "redis":
    server = RedisServer().start()
    pids, dirs = [server.pid], [str(server.directory)]
else:
    cluster = MooncakeCluster(storage_processes=1, segment_size="16MiB").start()
    pids, dirs = cluster.pids, [str(cluster.log_dir)]
print(json.dumps({"pids": pids, "dirs": dirs}), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever inherited it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_servers_die_with_the_process_that_started_them_even_on_sigkill(store):
    require_or_skip(RedisServer.available() if store == "redis" else MooncakeCluster.available())
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, store], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    started = json.loads(parent.stdout.readline() or "{}")
    try:
        assert started["pids"] and all(_running(pid) for pid in started["pids"])
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in started["pids"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in started["pids"] if _running(pid)]
    finally:
        parent.kill()
        for pid in started.get("pids", []):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        for directory in started.get("dirs", []):  # nobody was left to delete them
            shutil.rmtree(directory, ignore_errors=True)
