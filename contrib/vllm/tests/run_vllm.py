"""One vLLM engine with the kvconn connector, run as its own process by the tests.

``python run_vllm.py --model DIR --store DIR --tp N`` generates the same prompt twice
(greedy, with logprobs) through one ``LLM`` whose own prefix cache is off (unless
``--prefix-caching``), so every cached token of the second run came from kvconn, and
writes the outputs as JSON to ``--result FILE`` (not stdout, where at TP=2 the
workers' log lines land too). ``--marker RUN:NAME[:TEXT]`` writes a file that arms the
test backend (``plugins/kvconn_test_drop.py``) before generation ``RUN`` (1-based),
running the prompt that many times. ``--kvconn JSON`` puts kvconn on another store (a
server's backend and options) for one generation, which a fresh engine then reads back.
vLLM starts worker processes, hence the ``__main__`` guard.

The tiny random models are made here too (``MODELS``), with the geometries vLLM's CPU
backends accept: head_dim 64 for K/V attention, an MLA latent of 576 (512 + 64).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def tiny_llama_config(kv_heads: int, layers: int = 2, **more: Any) -> Any:
    """The tiny Llama's geometry (hidden 128, 2 heads of 64, a 512-token vocabulary)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **more,
    )


def make_tiny_llama(path: str, kv_heads: int, seed: int = 0, layers: int = 2) -> None:
    """A random Llama (2 layers, head_dim 64, ~4 MB) that vLLM's CPU backend accepts."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(kv_heads, layers)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


#: The tiny DeepSeek models' MLA geometry (a 576-element latent per token, 4 heads) and
#: their dense MLPs (no layer reaches ``first_k_dense_replace``).
TINY_MLA: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 100,
    "max_position_embeddings": 1024,
}


def make_tiny_deepseek_v2(path: str, seed: int = 0) -> None:
    """A random 2-layer DeepSeek-V2 (MLA: a 576-element latent per token, 4 heads)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(num_hidden_layers=2, **TINY_MLA)
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(path)


def make_tiny_deepseek_v3_mtp(path: str, seed: int = 0) -> None:
    """A random 2-layer DeepSeek-V3 (MLA, dense MLPs) with a multi-token-prediction
    layer (``num_nextn_predict_layers=1``): a third decoder layer with the MTP head's
    norms and projection, stored as DeepSeek ships it (``model.layers.2.*``)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        num_hidden_layers=3,  # the third becomes the MTP layer's decoder block
        n_group=1,
        topk_group=1,
        rope_scaling=None,
        **TINY_MLA,
    )
    DeepseekV3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    weights = load_file(str(Path(path, "model.safetensors")))
    mtp = "model.layers.2."
    weights |= {f"{mtp}{norm}.weight": torch.ones(256) for norm in ("enorm", "hnorm")}
    weights[f"{mtp}eh_proj.weight"] = torch.randn(256, 512) * 0.02
    weights[f"{mtp}shared_head.norm.weight"] = torch.ones(256)
    weights[f"{mtp}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[f"{mtp}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(Path(path, "model.safetensors")), metadata={"format": "pt"})
    hf = json.loads(Path(path, "config.json").read_text())
    hf |= {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    Path(path, "config.json").write_text(json.dumps(hf))


#: Layers of the tiny Gemma-3 with a sliding window (the others attend to everything).
GEMMA3_SLIDING_LAYERS = (0, 2)


def make_tiny_gemma3(path: str, seed: int = 0) -> None:
    """A random 4-layer Gemma-3: sliding-window (64 tokens) and full attention layers."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=1024,
    )
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path)


def make_tiny_qwen3_next(path: str, seed: int = 0) -> None:
    """A random 2-layer Qwen3-Next: one linear-attention (Gated DeltaNet) layer, one full."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts_per_tok=2,
        num_experts=4,
        layer_types=["linear_attention", "full_attention"],
    )
    Qwen3NextForCausalLM(config).to(torch.float32).save_pretrained(path)


#: The tiny Llama 4's attention chunk (tokens): two of the tests' 32-token blocks.
LLAMA4_CHUNK = 64


def make_tiny_llama4(path: str, seed: int = 0) -> None:
    """A random 4-layer Llama 4 text model: three chunked local attention layers (64-token
    chunks, RoPE) and a full-attention one (NoPE), every layer a 4-expert MoE."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        intermediate_size_mlp=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=LLAMA4_CHUNK,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    Llama4ForCausalLM(config).to(torch.float32).save_pretrained(path)


def make_tiny_llama_twin(path: str, kv_heads: int, seed: int = 0) -> None:
    """A random 2-layer Llama whose tokens depend on their context (weights drawn 15
    times wider than transformers' default: its default model picks nearly the same
    token whatever came before, and would accept any draft), with ``kv_heads`` KV
    heads that are copies of one. At 1 and 2 KV heads it is the same function, so one
    is the other's draft model and proposes exactly the tokens the target picks."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    weights = LlamaForCausalLM(tiny_llama_config(1, initializer_range=0.3)).state_dict()
    for name in [n for n in weights if n.endswith(("k_proj.weight", "v_proj.weight"))]:
        weights[name] = weights[name].repeat(kv_heads, 1)  # [heads * head_dim, hidden]
    model = LlamaForCausalLM(tiny_llama_config(kv_heads, initializer_range=0.3))
    model.load_state_dict(weights)
    model.to(torch.float32).save_pretrained(path)


def make_tiny_eagle(path: str, seed: int = 7) -> None:
    """A random EAGLE head for the tiny Llama (vLLM's ``EagleLlamaForCausalLM``): one
    decoder layer over the target's hidden state and the next token's embedding (its
    ``fc``); vLLM gives it the target's embeddings and LM head."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = tiny_llama_config(2, 1, architectures=["EagleLlamaForCausalLM"])
    shapes = {
        "self_attn.q_proj.weight": (128, 128),
        "self_attn.k_proj.weight": (128, 128),
        "self_attn.v_proj.weight": (128, 128),
        "self_attn.o_proj.weight": (128, 128),
        "mlp.gate_proj.weight": (256, 128),
        "mlp.up_proj.weight": (256, 128),
        "mlp.down_proj.weight": (128, 256),
    }
    # no input norm: vLLM's EAGLE layer 0 takes the fc output as it is
    weights = {f"layers.0.{name}": torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(128)
    weights["fc.weight"] = torch.randn(128, 256) * 0.02
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(path, "model.safetensors")))
    config.save_pretrained(path)


def make_tiny_lora(path: str, seed: int) -> None:
    """A random rank-8 LoRA adapter (PEFT's layout) for the 1-KV-head tiny Llama, on
    every attention projection: its K and V differ from the base model's, so a block
    computed under one adapter is wrong under another or under none."""
    import json

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    rank = 8
    outputs = {"q_proj": 128, "k_proj": 64, "v_proj": 64, "o_proj": 128}  # 1 KV head of 64
    weights = {}
    for layer in range(2):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, 128) * 0.1
            weights[f"{name}.lora_B.weight"] = torch.randn(out, rank) * 0.1
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(path, "adapter_model.safetensors")))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outputs),
        "base_model_name_or_path": "llama-1kv",
    }
    Path(path, "adapter_config.json").write_text(json.dumps(config))


#: Model name -> maker(path).
MODELS: dict[str, Callable[[str], None]] = {
    "llama-1kv": lambda path: make_tiny_llama(path, 1),
    "llama-2kv": lambda path: make_tiny_llama(path, 2),
    # one layer: its K/V are bit for bit the same at TP=1 and TP=2 (a second layer's
    # input went through TP=2's all-reduce, summed in another order)
    "llama-2kv-1layer": lambda path: make_tiny_llama(path, 2, layers=1),
    "deepseek-v2": make_tiny_deepseek_v2,
    "gemma3": make_tiny_gemma3,
    "qwen3-next": make_tiny_qwen3_next,
    "llama4": make_tiny_llama4,
    "llama-twin-1kv": lambda path: make_tiny_llama_twin(path, 1),
    "llama-twin-2kv": lambda path: make_tiny_llama_twin(path, 2),
    "eagle-llama": make_tiny_eagle,  # a draft head for llama-2kv
    "deepseek-v3-mtp": make_tiny_deepseek_v3_mtp,
    "lora-a": lambda path: make_tiny_lora(path, 1),  # adapters for llama-1kv
    "lora-b": lambda path: make_tiny_lora(path, 2),
}


def prompt_tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    Path(args.store).mkdir(parents=True, exist_ok=True)
    kvconn = {
        "model": f"tiny-{Path(args.model).name}",
        "backend": "lmdb",
        "options": {"path": args.store, "map_size": 64 * 2**20},
    }
    if args.backend:
        kvconn["backend"] = args.backend
    if args.kvconn:
        kvconn |= json.loads(args.kvconn)
    if args.stripe:
        kvconn["stripe_reads"] = True
    if args.shard_heads:
        kvconn["shard_heads"] = args.shard_heads
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        # a worker process per stage, as at TP > 1 (vLLM's choice there too)
        distributed_executor_backend="mp" if args.pp > 1 else None,
        dtype=args.dtype,  # CPU linear attention (GDN) needs bfloat16
        block_size=args.block_size or None,  # 0: vLLM's choice (CPU MLA forces 16)
        # vLLM prefers its AMX MLA backend where the CPU has AMX, which needs bf16
        # weights; the reference CPU_MLA backend runs float32 on any x86 CPU
        attention_config={"backend": args.attention_backend} if args.attention_backend else None,
        max_model_len=max(512, args.prompt_tokens + args.own_tokens + args.max_tokens + 64),
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.num_blocks or None,  # few blocks: reuse, preemption
        # off unless asked: every cached token must come from kvconn
        enable_prefix_caching=args.prefix_caching,
        enforce_eager=True,  # no torch.compile: start-up in seconds, not a minute
        mamba_cache_mode=args.mamba_cache_mode,
        # chunks of one block: vLLM's CPU kernels keep a Mamba state only at chunk ends
        max_num_batched_tokens=args.max_num_batched_tokens or None,
        long_prefill_token_threshold=args.long_prefill_token_threshold,  # per request
        disable_log_stats=False,
        kv_transfer_config=transfer_config(args, kvconn),
        speculative_config=speculative_config(args),
        **({"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if args.lora else {}),
    )
    if args.workload == "concurrent":
        return concurrent(llm, args)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, detokenize=False)
    tokens = prompt_tokens(args.prompt_tokens)
    salts = args.cache_salt.split(",") if args.cache_salt else []
    adapters = args.lora.split(",") if args.lora else []
    markers: dict[int, list[tuple[str, str]]] = {}
    for spec in args.marker:
        run_number, name, *text = spec.split(":", 2)
        markers.setdefault(int(run_number), []).append((name, text[0] if text else ""))
    runs = []
    for n in range(1, max([args.generations, len(salts), len(adapters), *markers]) + 1):
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salts:  # vLLM's per-request cache isolation (one tenant's salt)
            prompt["cache_salt"] = salts[(n - 1) % len(salts)]
        if n > 1 and args.connector == "kvconn":
            settle(args.store)
        if n > 1 and args.prefix_caching and args.reset_prefix_cache:
            llm.reset_prefix_cache()  # what vLLM had, kvconn must bring
        for name, text in markers.get(n, []):
            Path(args.store, name).write_text(text)  # read by kvconn_test_drop
        started = time.monotonic()
        drafted = speculation(llm)
        lora = lora_request(adapters[(n - 1) % len(adapters)]) if adapters else None
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        seconds = time.monotonic() - started
        now = speculation(llm)
        runs.append(
            {
                **completion(out),
                "seconds": seconds,
                # draft tokens proposed and accepted in this generation (speculative only)
                "drafted": {k: now[k] - drafted[k] for k in now},
            }
        )
        Path(args.store, "stall").unlink(missing_ok=True)  # a stall lasts one run
    return {"runs": runs}


def lora_request(adapter: str) -> Any:
    """The LoRA adapter in directory ``adapter`` (its id from its path), or ``-``: none."""
    import zlib

    from vllm.lora.request import LoRARequest

    if adapter == "-":
        return None
    return LoRARequest(Path(adapter).name, 1 + zlib.crc32(adapter.encode()) % 10_000, adapter)


def transfer_config(args: argparse.Namespace, kvconn: dict[str, Any]) -> Any:
    """kvconn, vLLM's own reference connector (files per layer), or none."""
    from vllm.config import KVTransferConfig

    if args.connector == "none":
        return None
    if args.connector == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.store},
        )
    return KVTransferConfig(
        kv_connector="KvconnConnector",
        kv_connector_module_path="kvconn_vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=kvconn,
    )


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """A draft model proposing tokens the target checks (``--draft DIR``), or none."""
    if not args.draft:
        return None
    return {
        "method": args.draft_method,
        "model": args.draft,
        "num_speculative_tokens": args.draft_tokens,
        "disable_eagle_block_drop": args.keep_eagle_block,
    }


def speculation(llm: Any) -> dict[str, int]:
    """vLLM's running counts of draft tokens proposed and accepted."""
    counts = {m.name: int(getattr(m, "value", 0)) for m in llm.get_metrics()}
    return {
        what: counts.get(f"vllm:spec_decode_num_{what}_tokens", 0) for what in ("draft", "accepted")
    }


def completion(out: Any) -> dict[str, Any]:
    done = out.outputs[0]
    return {
        "token_ids": list(done.token_ids),
        "logprobs": [
            {str(t): lp.logprob for t, lp in sorted(step.items())} for step in done.logprobs or []
        ],
        "num_cached_tokens": out.num_cached_tokens,
    }


def concurrent(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--requests`` prompts sharing a prefix, generated together (one batch, so vLLM
    interleaves them, preempts them when ``--num-blocks`` is short, and hands the
    blocks of finished ones to the others at once); then the saves are let land."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    shared = prompt_tokens(args.prompt_tokens)
    prompts = [
        TokensPrompt(prompt_token_ids=shared + prompt_tokens(args.own_tokens, seed=100 + i))
        for i in range(args.requests)
    ]
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, logprobs=3, detokenize=False
    )
    started = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - started
    settle(args.store)
    metrics = {m.name: int(getattr(m, "value", 0)) for m in llm.get_metrics()}
    return {
        "requests": [completion(out) for out in outs],
        "seconds": seconds,
        "preemptions": metrics.get("vllm:num_preemptions", 0),
        # prompt tokens found in vLLM's own cache, and those a connector loaded
        "local_hits": metrics.get("vllm:prefix_cache_hits", 0),
        "external_hits": metrics.get("vllm:external_prefix_cache_hits", 0),
    }


def settle(store: str, quiet_s: float = 0.5, limit_s: float = 30.0) -> None:
    """Wait until the store stops growing: saves land in the background now, after the
    request that made them has finished, and the next run should find them."""
    from kvconn_lmdb import LmdbBackend

    deadline = time.monotonic() + limit_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        backend = LmdbBackend(store)
        try:
            count = sum(1 for _ in backend.list_keys())
        finally:
            backend.close()
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--backend", default=None)
    parser.add_argument(
        "--kvconn",
        metavar="JSON",
        help="kvconn settings over the LMDB store's (a server's backend and options)",
    )
    parser.add_argument("--generations", type=int, default=2, help="times the prompt runs")
    parser.add_argument("--shard-heads", type=int, default=0, help="kvconn's shard_heads")
    parser.add_argument("--connector", choices=("kvconn", "example", "none"), default="kvconn")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--marker", action="append", default=[], metavar="RUN:NAME[:TEXT]")
    parser.add_argument("--workload", choices=("repeat", "concurrent"), default="repeat")
    parser.add_argument("--stripe", action="store_true", help="kvconn's stripe_reads")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache")
    parser.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="empty vLLM's prefix cache before each generation after the first",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mamba-cache-mode", default="none", help="vLLM's: none or align")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--own-tokens", type=int, default=36)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=0)
    parser.add_argument("--draft", metavar="DIR", help="a draft model: speculative decoding")
    parser.add_argument("--draft-method", default="eagle", help="vLLM's speculative method")
    parser.add_argument("--draft-tokens", type=int, default=2, help="tokens proposed a step")
    parser.add_argument(
        "--lora",
        metavar="DIR,...",
        help="the LoRA adapter of the prompt in each generation ('-': none; as many "
        "generations as adapters)",
    )
    parser.add_argument(
        "--cache-salt",
        metavar="SALT,SALT...",
        help="the prompt's cache salt in each generation (as many generations as salts)",
    )
    parser.add_argument(
        "--keep-eagle-block",
        action="store_true",
        help="vLLM's disable_eagle_block_drop: an EAGLE/MTP hit keeps its last block",
    )
    parser.add_argument("--result", metavar="FILE", help="where the outputs' JSON goes")
    args = parser.parse_args()
    if args.kvconn and args.generations > 1:
        # settle() waits for saves by watching the LMDB store: another store's saves
        # would not be waited for, and a second generation would race them
        parser.error("--kvconn runs one generation: a fresh engine reads what this one saved")
    result = run(args)
    if args.result:
        Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
