"""``kvconn dev-server``: real servers a developer can point kvconn at, stopped by Ctrl-C,
gone when whoever started them dies, and a bad flag is one line that names it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvconn.registry import load_backend
from kvconn.testing.suite import require_or_skip
from kvconn.tools.cli import main
from kvconn.tools.devserver._process import HttpChild, TcpChild
from kvconn.tools.devserver.mooncake import MooncakeCluster, keep_transfers_on_loopback
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


def test_a_dev_server_runs_in_a_group_of_its_own_but_in_our_session():
    """Its own group, so stopping it reaches what it forked; our session, so the kernel's
    autogroup scheduling does not make it a group an engine can starve of CPU."""
    require_or_skip(RedisServer.available())
    with RedisServer() as server:
        assert server.pid is not None
        assert os.getpgid(server.pid) == server.pid
        assert os.getsid(server.pid) == os.getsid(0)


def test_a_redis_password_never_appears_on_the_server_command_line():
    """``ps`` shows every process's command line, and mirakuru logs it at DEBUG."""
    require_or_skip(RedisServer.available())
    secret = "s3cret-in-a-file-only"
    with RedisServer(password=secret) as server:
        assert server.pid is not None
        with open(f"/proc/{server.pid}/cmdline", "rb") as fh:
            assert secret.encode() not in fh.read()
        reply = server.command("PING")
        assert reply in (b"PONG", "PONG")


# ------------------------------------------------------- Ctrl-C in every phase (issue 15)
def _slow_redis_server(directory: Path, delay_s: float) -> Path:
    """A ``redis-server`` that notes its pid, sleeps ``delay_s``, then becomes the real one.

    Put first on PATH (or given as ``binary``), it holds a start in "waiting for the
    server" long enough to interrupt it there; ``--version`` answers at once.
    """
    real = shutil.which("redis-server")
    assert real is not None
    path = directory / "redis-server"
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then exec {real} "$@"; fi\n'
        f'echo $$ >> "{directory}/pids"\n'
        f"sleep {delay_s}\n"
        f'exec {real} "$@"\n'
    )
    path.chmod(0o755)
    return path


def _pids_started(directory: Path) -> list[int]:
    try:
        return [int(line) for line in (directory / "pids").read_text().split()]
    except FileNotFoundError:
        return []


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_start_interrupted_while_waiting_for_the_server_stops_it_before_the_interrupt_goes_on(
    tmp_path,
):
    """The interrupted start's server was held only by the traceback's frames: it ran
    for as long as anything kept the traceback (a test report, a logged exc_info, an
    interactive session's last traceback), until mirakuru's executor was collected."""
    require_or_skip(RedisServer.available())
    server = RedisServer(binary=str(_slow_redis_server(tmp_path, 30)))

    def interrupt_once_it_runs() -> None:
        _wait_for(lambda: _pids_started(tmp_path), timeout=30)
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_it_runs, daemon=True)
    interrupter.start()
    try:
        server.start()
    except KeyboardInterrupt:
        (pid,) = _pids_started(tmp_path)
        alive = _running(pid)  # asked while the interrupt, and its traceback, live
    else:
        pytest.fail("the start was not interrupted")
    finally:
        interrupter.join()
    assert not alive
    assert server.directory is None


@pytest.mark.parametrize(
    ("kind", "where"),
    [(TcpChild, {"host": "127.0.0.1", "port": 1}), (HttpChild, {"url": "http://127.0.0.1:1/"})],
)
def test_a_ctrl_c_during_the_readiness_check_stays_a_keyboard_interrupt(
    kind: type[TcpChild | HttpChild], where: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mirakuru's check closes a socket that a Ctrl-C may have kept from existing; its
    ``UnboundLocalError`` then hid the interrupt (a CI run of the test above)."""
    child = kind(["true"], **where)

    def interrupted(*args: object, **kwargs: object) -> socket.socket:
        raise KeyboardInterrupt

    monkeypatch.setattr(socket, "socket", interrupted)
    with pytest.raises(KeyboardInterrupt):
        child.pre_start_check()


def _ignores_sigterm(directory: Path) -> Path:
    """A stand-in server that listens on its ``--port`` and ignores SIGTERM."""
    path = directory / "stubborn-server"
    path.write_text(
        f"#!{sys.executable}\n"
        "import signal, socket, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "listener = socket.create_server(('127.0.0.1', port))\n"
        "while True:\n"
        "    listener.accept()[0].close()\n"
    )
    path.chmod(0o755)
    return path


def test_servers_that_ignore_sigterm_are_killed_after_one_short_grace_not_one_per_node(tmp_path):
    """Stops waited for SIGTERM as long as a start may take (15 s for Redis), one node
    after another: 45 s for a 3-node cluster whose nodes were slow to exit."""
    from kvconn.tools.devserver._process import STOP_GRACE_S
    from kvconn.tools.devserver.redis import RedisCluster

    cluster = RedisCluster(3, binary=str(_ignores_sigterm(tmp_path)))
    try:
        for node in cluster.nodes:
            node.start()
        pids = [node.pid for node in cluster.nodes]
        started = time.monotonic()
        cluster.stop()
        took = time.monotonic() - started
    finally:
        cluster.stop()
    # one grace per node would be 15 s; one grace plus the kills and reaps took 5.0 s
    # alone and 9.7 s beside two vLLM engines on a 2-CPU machine
    assert STOP_GRACE_S <= took < 2.5 * STOP_GRACE_S, took
    assert not [pid for pid in pids if pid is not None and _running(pid)]


def _burn_cpu(processes: int) -> list[subprocess.Popen[bytes]]:
    """CPU-bound processes, so the dev server is stopped on a loaded machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]


#: Seconds a loaded machine may take, after the signal, until the dev server has exited
#: with every process it started (measured: under 2 s with twice as many CPU burners as
#: cores on a 2-core machine; a stop that waits out a start took 8 s and more).
EXIT_BOUND_S = 6.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "sig"),
    [
        ("starting", signal.SIGINT),
        ("waiting for the server", signal.SIGINT),
        ("waiting for the server", signal.SIGTERM),
        ("serving", signal.SIGINT),
        ("serving", signal.SIGTERM),
    ],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_kvconn_dev_server_stops_promptly_on_a_signal_in_every_phase_under_load(
    tmp_path, phase, sig
):
    require_or_skip(RedisServer.available())
    _slow_redis_server(tmp_path, 8 if phase == "waiting for the server" else 0)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    burners = _burn_cpu(2 * (os.cpu_count() or 1))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconn.tools.cli", "dev-server", "redis", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        if phase == "starting":
            time.sleep(0.3)  # the interpreter and kvconn are still loading
        elif phase == "waiting for the server":
            _wait_for(lambda: _pids_started(tmp_path))
            time.sleep(0.2)
        else:
            assert json.loads(proc.stdout.readline())["url"].startswith("redis://")
        sent = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
        took = time.monotonic() - sent
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert took < EXIT_BOUND_S, (took, proc.stderr.read() if proc.stderr else "")
    # Ctrl-C while Python itself starts is Python's own: a KeyboardInterrupt exit
    assert code in ((0, 130, 1, -signal.SIGINT) if phase == "starting" else (0,)), code
    assert not [pid for pid in _pids_started(tmp_path) if _running(pid)]


def test_clients_made_here_transfer_over_loopback_unless_the_caller_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "unset below")  # restored to absent afterwards
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS")
    keep_transfers_on_loopback()
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "10.0.0.7")
    keep_transfers_on_loopback()
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "10.0.0.7"
