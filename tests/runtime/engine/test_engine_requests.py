"""Engine behaviour around requests: bad input, aborts, timeouts, stop strings, n > 1, seeds, chat, the
progress bar."""

from __future__ import annotations

import functools
import io
import re
import time
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.outputs import OutputKind
from tqdm import tqdm


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(
        str(tiny_llama),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=8,
        max_model_len=512,
        max_num_batched_tokens=64,
    )


def _assert_all_blocks_released(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.stats.kv_cache_usage == 0.0, "blocks still held by a request"


def _greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "empty"),
        ([[]], None, "empty"),
        ([1, 2, 10**9], None, "outside the vocabulary"),
        ([1, -3], None, "outside the vocabulary"),
        ("word " * 5000, None, "context"),
    ],
)
def test_bad_prompts_are_rejected_and_engine_keeps_working(llm: LLM, prompt, params, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params or _greedy())
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("hello there", _greedy())[0].outputs[0].token_ids) == 8


def test_bad_request_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", ""], _greedy())
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_abort_mid_generation_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"abort-{i}", [5 + i] * 20, _greedy(max_tokens=50))
    for _ in range(4):
        engine.step()
    usage_before = engine.stats.kv_cache_usage
    assert usage_before > 0
    engine.abort_request(["abort-0", "abort-1"])
    assert engine.stats.kv_cache_usage < usage_before
    engine.abort_request("abort-2")
    engine.abort_request("no-such-request")  # unknown ids are ignored
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["abort-3"]
    _assert_all_blocks_released(llm)


def test_abort_of_waiting_request(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("waiting", [7] * 30, _greedy())
    engine.abort_request("waiting")
    assert not engine.has_unfinished_requests()
    _assert_all_blocks_released(llm)


def test_timeout_ends_request_as_timed_out(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("slow", [9] * 12, _greedy(max_tokens=200), timeout=0.05)
    engine.add_request("fast", [9] * 12, _greedy(max_tokens=4))
    outputs = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        time.sleep(0.01)
    assert outputs["slow"].outputs[0].finish_reason == "timeout"
    assert len(outputs["slow"].outputs[0].token_ids) < 200
    assert outputs["fast"].outputs[0].finish_reason == "length"
    _assert_all_blocks_released(llm)


def test_stop_string_cuts_text(llm: LLM) -> None:
    free_run = llm.generate("the weather today", _greedy(max_tokens=16))[0].outputs[0]
    text = free_run.text
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate("the weather today", _greedy(max_tokens=16, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        "the weather today", _greedy(max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    )
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]
    _assert_all_blocks_released(llm)


def test_a_stop_string_the_last_token_completes_is_the_stop_not_the_length(llm: LLM) -> None:
    text = llm.generate("the weather today", _greedy(max_tokens=16))[0].outputs[0].text
    # The shortest end of the text found nowhere before: the 16th token completes it.
    stop = next(text[-n:] for n in range(1, len(text) + 1) if text.index(text[-n:]) == len(text) - n)
    cut = llm.generate("the weather today", _greedy(max_tokens=16, stop=[stop]))[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", stop, text[: -len(stop)])
    assert len(cut.token_ids) == 16
    _assert_all_blocks_released(llm)


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free_run = llm.generate([11, 12, 13], _greedy(max_tokens=10))[0].outputs[0]
    assert free_run.finish_reason == "length"
    stop_id = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_id)
    out = llm.generate([11, 12, 13], _greedy(max_tokens=10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == free_run.token_ids[: first + 1]


def test_min_tokens_holds_back_stop_tokens(llm: LLM) -> None:
    free_run = llm.generate([21, 22], _greedy(max_tokens=10))[0].outputs[0]
    stop_id = free_run.token_ids[0]
    out = llm.generate([21, 22], _greedy(max_tokens=10, stop_token_ids=[stop_id], min_tokens=5))[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 5
    assert stop_id not in tokens[:5]


def test_n_samples_and_seeds(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=42, ignore_eos=True)
    first = llm.generate("once upon a time", params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "n samples should differ"
    # The same seed gives the same samples, whatever else shares the batch.
    noise = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    batch = llm.generate(["a", "b", "once upon a time", "c", "d", "e"], [*noise[:2], params, *noise[2:]])
    assert [c.token_ids for c in batch[2].outputs] == [c.token_ids for c in first.outputs]
    _assert_all_blocks_released(llm)


def test_logprobs_cover_top_n_and_sampled_token(llm: LLM) -> None:
    out = llm.generate("logprobs please", SamplingParams(temperature=1.0, max_tokens=6, logprobs=3, seed=1))[
        0
    ]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in step
        assert len(step) in (3, 4)
        assert all(v <= 0.0 for v in step.values())
        total += step[token_id]
    assert completion.cumulative_logprob == pytest.approx(total)


def test_chat_applies_template(llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    ids = llm.apply_chat_template(messages)
    text = llm.get_tokenizer().decode(ids)
    assert "You are terse." in text and "Say something." in text
    out = llm.chat(messages, _greedy(max_tokens=5))
    assert out[0].prompt_token_ids == ids
    assert len(out[0].outputs[0].token_ids) == 5


def test_generate_shows_a_progress_bar_unless_told_not_to(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["one", "two three four", [5, 6, 7, 8, 9, 10, 11]]
    params = [_greedy(max_tokens=n) for n in (3, 6, 9)]
    capsys.readouterr()
    outputs = llm.generate(prompts, params)
    final = capsys.readouterr().err.strip().split("\r")[-1]
    counted = re.search(r"^Processed prompts: 100%.* (\d+)/(\d+) \[", final)
    assert counted and counted.groups() == ("3", "3"), final
    # Both speeds are over the same elapsed time: their ratio is that of the tokens the outputs hold.
    speeds = re.search(r"est. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", final)
    assert speeds, final
    input_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert output_tokens == 18
    speed_in, speed_out = (float(speed) for speed in speeds.groups())
    assert speed_out / speed_in == pytest.approx(output_tokens / input_tokens, rel=0.01), final

    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in outputs
    ]
    assert capsys.readouterr().err == ""
    elsewhere = io.StringIO()
    chat = [{"role": "user", "content": "Hi."}]
    llm.chat(chat, _greedy(), use_tqdm=functools.partial(tqdm, file=elsewhere))
    assert capsys.readouterr().err == "" and "Processed prompts: 100%" in elsewhere.getvalue()


def test_streaming_deltas_add_up_to_the_final_text(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("stream", "streaming text", _greedy(max_tokens=10), output_kind=OutputKind.DELTA)
    text, tokens, finished = "", [], False
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.outputs[0].text
            tokens += output.outputs[0].token_ids
            finished = output.finished
    assert finished and len(tokens) == 10
    final = llm.generate("streaming text", _greedy(max_tokens=10))[0].outputs[0]
    assert tokens == final.token_ids
    assert text == final.text


def test_chat_template_override_from_text_and_file(tiny_llama: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
    inline = LLM(str(tiny_llama), num_gpu_blocks_override=64, max_model_len=256, chat_template=template)
    ids = inline.apply_chat_template([{"role": "user", "content": "hi"}])
    assert inline.get_tokenizer().decode(ids) == "<<user>>hi"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    from_file = LLM(str(tiny_llama), num_gpu_blocks_override=64, max_model_len=256, chat_template=str(path))
    assert from_file.apply_chat_template([{"role": "user", "content": "hi"}]) == ids
    with pytest.raises(ValueError, match="neither a readable file"):
        LLM(
            str(tiny_llama),
            num_gpu_blocks_override=64,
            max_model_len=256,
            chat_template=str(tmp_path / "missing"),
        )


def test_outputs_carry_a_snapshot_of_the_request_times(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("timed", "time me", _greedy(max_tokens=3), output_kind=OutputKind.DELTA)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    first, last = seen[0].metrics, seen[-1].metrics
    assert first is not last
    assert first.finished_time is None, "an earlier output must not change after it was handed out"
    times = [last.arrival_time, last.first_scheduled_time, last.first_token_time, last.finished_time]
    assert None not in times and times == sorted(times)
