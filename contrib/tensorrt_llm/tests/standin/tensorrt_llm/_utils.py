"""``mpi_rank``: in TensorRT-LLM each rank is an MPI process; here the stand-in executor
sets the rank in the environment of the process it starts."""

from __future__ import annotations

import os

RANK_ENV = "TRTLLM_STANDIN_RANK"


def mpi_rank() -> int:
    return int(os.environ.get(RANK_ENV, "0"))
