"""``kvconn dev-server``: real servers a developer can point kvconn at, stopped by Ctrl-C."""

import json
import signal
import subprocess
import sys

import pytest

from kvconn.registry import load_backend
from kvconn.testing.suite import require_or_skip
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
