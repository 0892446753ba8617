"""Fixtures shared by the vLLM adapter's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_vllm import make_tiny_llama


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny random Llamas with 1 and 2 KV heads, made with transformers at test time.

    Made in this process: one import of transformers for both, not a process each.
    """
    root = tmp_path_factory.mktemp("models")
    out = {}
    for heads in (1, 2):
        out[heads] = root / f"llama-{heads}kv"
        make_tiny_llama(str(out[heads]), heads)
    return out
