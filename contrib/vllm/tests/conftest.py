"""Fixtures shared by the vLLM adapter's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_process import run_script


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny random Llamas with 1 and 2 KV heads, made with transformers at test time."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for heads in (1, 2):
        path = root / f"llama-{heads}kv"
        done = run_script("--model", str(path), "--store", "-", "--make-model-kv-heads", str(heads))
        assert done.returncode == 0, done.stderr[-3000:]
        out[heads] = path
    return out
