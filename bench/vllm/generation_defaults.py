"""vLLM's side of the generation-config parity test (bench/vllm/tests/test_generation_config_parity.py): the
offline `vllm.LLM`'s default sampling parameters under the generation config options it is given, and its
answers to prompts generated without SamplingParams. Runs in vLLM's own environment.

    python -P bench/vllm/generation_defaults.py --model DIR --options options.json --prompts prompts.json \
        --result-json result.json

options.json: LLM keyword arguments (generation_config, override_generation_config); prompts.json: [token ids,
...]; result.json: {"defaults": {field: value}, "outputs": [[token ids, finish reason, stop reason], ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# The SamplingParams fields a generation_config.json can set.
FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--options", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--result-json", type=Path, required=True)
    args = parser.parse_args()
    # vLLM sizes its CPU KV cache from this variable (GiB) when the engine starts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    options = json.loads(args.options.read_text())
    llm = LLM(str(args.model), dtype="float32", seed=0, max_model_len=512, **options)
    defaults = llm.get_default_sampling_params()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(args.prompts.read_text())]
    outputs = [output.outputs[0] for output in llm.generate(prompts, use_tqdm=False)]
    result = {
        "defaults": {name: getattr(defaults, name) for name in FIELDS},
        "outputs": [[list(o.token_ids), o.finish_reason, o.stop_reason] for o in outputs],
    }
    args.result_json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
