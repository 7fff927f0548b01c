"""Transformers' beam search, the reference for kvfleet's: the same folder's best beams and, for each, the sum
of its tokens' logprobs by one forward pass of the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def transformers_beams(
    model_dir: Path, prompt_ids: list[int], width: int, max_new_tokens: int
) -> list[tuple[list[int], float]]:
    """(output tokens, cumulative logprob) of the `width` best beams of `max_new_tokens` tokens, best first,
    with the end tokens of the folder's generation config ruled out (every beam runs to its length, as
    kvfleet's beams do with ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generation = json.loads((model_dir / "generation_config.json").read_text())
    ends = generation["eos_token_id"]
    ends = ends if isinstance(ends, list) else [ends]
    prompt = torch.tensor([prompt_ids])
    with torch.inference_mode():
        found = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            suppress_tokens=ends,
            pad_token_id=ends[0],
        )
        beams = []
        for sequence in found:
            logprobs = torch.log_softmax(model(sequence[None]).logits[0], dim=-1)
            outputs = sequence[len(prompt_ids) :].tolist()
            positions = range(len(prompt_ids) - 1, len(sequence) - 1)
            scored = sum(
                logprobs[position, token].item() for position, token in zip(positions, outputs, strict=True)
            )
            beams.append((outputs, scored))
    return beams
