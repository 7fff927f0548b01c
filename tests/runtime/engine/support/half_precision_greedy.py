"""Greedy tokens of kvfleet and of Transformers on one model folder in one dtype, with each side's top-5 at
every step, printed as JSON. It runs in a process of its own so that ATEN_CPU_CAPABILITY, which torch reads
when it loads, can mask CPU features for both sides.

usage: half_precision_greedy.py FOLDER DTYPE MAX_TOKENS PROMPTS_JSON
"""

from __future__ import annotations

import json
import logging
import sys

import torch
from kvfleet.runtime import LLM, SamplingParams
from transformers import AutoModelForCausalLM

TOP_N = 5


def main() -> None:
    folder, dtype, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    logging.basicConfig(level=logging.INFO)
    llm = LLM(folder, dtype=dtype, num_gpu_blocks_override=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_N)
    ours = [output.outputs[0] for output in llm.generate(prompts, params)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    cases = []
    for prompt, output in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            reference = model.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        cases.append(
            {
                "tokens": list(output.token_ids),
                "tops": [sorted(step, key=step.get, reverse=True)[:TOP_N] for step in output.logprobs],
                "reference_tokens": reference.sequences[0, len(prompt) :].tolist(),
                "reference_tops": [step[0].topk(TOP_N).indices.tolist() for step in reference.logits],
            }
        )
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
