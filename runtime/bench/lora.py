"""Multi-LoRA offline: throughput of a batch spread over several adapters against the base model alone.

Both runs take the same seeded requests (prompt and output lengths, ignore_eos) through one engine with LoRA
enabled; the adapters are random PEFT adapters of the given rank on every projection, written to a temporary
folder. The mixed run gives request i adapter i mod N.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvfleet.runtime.bench.throughput import ThroughputResult
from kvfleet.runtime.bench.workloads import random_requests
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.lora.make_adapter import make_adapter
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.sampling_params import SamplingParams


def run_lora(
    model_path: str,
    *,
    num_requests: int,
    num_adapters: int,
    rank: int,
    engine_options: dict,
    seed: int,
    log: Callable[[str], None],
) -> tuple[ThroughputResult, ThroughputResult]:
    options = {**engine_options, "enable_lora": True, "max_loras": num_adapters, "max_lora_rank": rank}
    llm = LLM(model_path, **options)
    requests = random_requests(num_requests, (16, 256), (16, 128), llm.llm_engine.vocab_size, seed=seed)
    prompts = [request.prompt_token_ids for request in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        for request in requests
    ]
    output_tokens = sum(request.output_len for request in requests)
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-lora-") as folder:
        loras = [
            LoRARequest(
                f"adapter-{i}", i + 1, str(make_adapter(model_path, Path(folder) / str(i), rank=rank, seed=i))
            )
            for i in range(num_adapters)
        ]
        mixed = [loras[i % num_adapters] for i in range(num_requests)]
        log("warming up")
        llm.generate(
            prompts[:num_adapters], params[:num_adapters], lora_request=mixed[:num_adapters], use_tqdm=False
        )
        results = []
        for name, lora_request in (("base model", None), (f"{num_adapters} adapters, rank {rank}", mixed)):
            log(f"running {num_requests} requests: {name}")
            start = time.perf_counter()
            llm.generate(prompts, params, lora_request=lora_request)
            results.append(ThroughputResult(name, time.perf_counter() - start, output_tokens))
    base, with_adapters = results
    return base, with_adapters
