"""Running ``run_vllm.py`` as its own process, with the environment vLLM needs on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def engine_env(tp: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a share of host memory
        PYTHONPATH=os.pathsep.join([str(HERE / "plugins"), env.get("PYTHONPATH", "")]),
    )
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        # vLLM reserves one more core for a KV connector's engine; with one reserved
        # everywhere, engines with and without a connector compute on the same threads
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return env


def run_script(*args: str, tp: int = 1, timeout: int = 540) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "run_vllm.py"), *args],
        env=engine_env(tp),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
