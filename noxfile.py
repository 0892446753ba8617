"""Engine adapters' tests, each in its own virtual environment.

Engines pin packages that conflict with each other (and SGLang's own requirements would
pull a CUDA build of torch), so every engine gets a session of its own with exactly the
packages its tests import; ``scripts/test.sh`` runs them after the main suite. One
function per engine: ``nox -s sglang`` runs one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import nox

nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
#: The CPU build on this project's machines; a plain ``torch`` resolves a CUDA build.
TORCH = "torch==2.13.0"


def _install_once(session: nox.Session, requirements: Path, *extra: str) -> None:
    """Install torch, the engine's pinned no-deps set and kvconn, unless already done.

    A reused environment whose inputs are unchanged is not reinstalled: resolving ~60
    pinned wheels again costs longer than the tests.
    """
    inputs = [TORCH, requirements.read_text(), (ROOT / "pyproject.toml").read_text(), *extra]
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()
    stamp = Path(session.virtualenv.location) / ".kvconn-installed"
    if stamp.exists() and stamp.read_text() == digest:
        return
    session.install(TORCH)
    session.install("--no-deps", "-r", str(requirements))
    session.install("-e", str(ROOT), "pytest", *extra)
    stamp.write_text(digest)


@nox.session
def sglang(session: nox.Session) -> None:
    """kvconn as SGLang's HiCache L3 storage, under SGLang 0.5.23's real controller."""
    _install_once(session, ROOT / "contrib/sglang/requirements.txt")
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "contrib/sglang/tests",
        *session.posargs,
    )
