"""One vLLM engine with the kvconn connector, run as its own process by the tests.

``python run_vllm.py --model DIR --store DIR --tp N`` generates the same prompt twice
(greedy, with logprobs) through one ``LLM`` whose own prefix cache is off, so every
cached token of the second run came from kvconn, and prints the outputs as one JSON
line. ``--drop-on-third`` runs it a third time after asking the test backend to delete
a page between lookup and load. vLLM starts worker processes, hence the ``__main__``
guard.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any


def make_tiny_llama(path: str, kv_heads: int, seed: int = 0) -> None:
    """A random 2-layer Llama (head_dim 64, ~4 MB) that vLLM's CPU backend accepts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def prompt_tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kvconn = {
        "model": "tiny-llama-test",
        "backend": "lmdb",
        "options": {"path": args.store, "map_size": 64 * 2**20},
    }
    if args.backend:
        kvconn["backend"] = args.backend
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        max_num_seqs=4,
        enable_prefix_caching=False,  # every cached token must come from kvconn
        enforce_eager=True,  # no torch.compile: start-up in seconds, not a minute
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvconnConnector",
            kv_connector_module_path="kvconn_vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=kvconn,
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=prompt_tokens(args.prompt_tokens))
    runs = []
    for n in range(3 if args.drop_on_third else 2):
        if n == 2:
            Path(args.store, "drop-next-load").touch()  # read by kvconn_test_drop
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        runs.append(
            {
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    {str(t): lp.logprob for t, lp in sorted(step.items())}
                    for step in completion.logprobs or []
                ],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    return {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--drop-on-third", action="store_true")
    parser.add_argument("--make-model-kv-heads", type=int, default=None)
    args = parser.parse_args()
    if args.make_model_kv_heads is not None:
        make_tiny_llama(args.model, args.make_model_kv_heads)
        return
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
