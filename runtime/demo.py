"""`kvfleet demo` on the runtime alone: a tiny model, a few prompts, outputs and throughput."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

DEMO_PROMPTS = [
    "The weather in the mountains",
    "A good recipe for bread starts with",
    "Computers store numbers as",
    "The river runs past the old mill and",
]


def run_demo(workdir: str | None) -> None:
    from kvfleet.runtime import LLM, SamplingParams
    from kvfleet.runtime.models.make_model import make_model

    with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as scratch:
        model_dir = Path(workdir or scratch) / "tiny-llama"
        print(f"making a tiny Llama model in {model_dir}")
        make_model("llama", "tiny", str(model_dir), seed=0, dtype="float32")
        llm = LLM(str(model_dir))
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)
        start = time.perf_counter()
        outputs = llm.generate(DEMO_PROMPTS, params)
        seconds = time.perf_counter() - start
        for prompt, output in zip(DEMO_PROMPTS, outputs, strict=True):
            print(f"\n> {prompt}\n{output.outputs[0].text!r}")
        chat = llm.chat([{"role": "user", "content": "Tell me about rivers."}], params)[0].outputs[0]
        print(f"\n[chat] user: Tell me about rivers.\n[chat] assistant: {chat.text!r}")
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            f"\n{len(outputs)} requests, {tokens} tokens in {seconds:.2f} s: "
            f"{tokens / seconds:.0f} output tokens/s"
        )
        print("(random weights: the text is noise; the machinery is real)")
