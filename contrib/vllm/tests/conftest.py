"""Fixtures shared by the vLLM adapter's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from run_vllm import MODELS


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A tiny random model by name (``run_vllm.MODELS``), made with transformers the
    first time a test asks for it.

    Made in this process: one import of transformers for all, not a process each.
    """
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            MODELS[name](str(root / name))
            made[name] = root / name
        return made[name]

    return get
