"""Structured outputs in the engine: constrained requests follow their regex, choice or grammar whatever the
random model would say, fail alone when their grammar is bad, and leave unconstrained requests untouched."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import msgspec
import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams, StructuredOutputsParams
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.engine.core import EngineCore
from kvfleet.runtime.engine.grammar_compiler import GrammarCompiler, RequestGrammar
from kvfleet.runtime.engine.messages import AddRequest, to_core_decoder
from kvfleet.runtime.request import Request
from kvfleet.runtime.structured_outputs.masks import GrammarMasks
from processes import child_processes
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["The weather today", "Write a list:", "1 2 3", "Hello there, my friend"]
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{1,3}( [xy])?"
CHOICES = ["red", "green", "light blue", 'say "hi"']
# EBNF: a sum of one to three single-digit numbers, then "=" and one to two digits.
GRAMMAR = 'root ::= term (" + " term){0,2} " = " digit digit?\nterm ::= digit\ndigit ::= [0-9]'
GRAMMAR_AS_REGEX = r"[0-9]( \+ [0-9]){0,2} = [0-9]{1,2}"
LONG_REGEX = r"[a-z]{80,100}\."
COMPILE_WORKER_MODULE = "kvfleet.runtime.structured_outputs.compile_worker"


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=128, block_size=8, max_model_len=256)


def _constrained(seed: int, max_tokens: int = 64, **structured: object) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**structured),
    )


@pytest.mark.parametrize(
    ("structured", "matches"),
    [
        ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
        ({"choice": CHOICES}, lambda text: text in CHOICES),
        ({"grammar": GRAMMAR}, lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) is not None),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_constrained_outputs_always_match(llm: LLM, structured: dict, matches) -> None:
    params = [_constrained(seed, **structured) for seed in range(12)]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert matches(completion.text), completion.text


def test_json_schema_output_validates(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 3},
            "rain": {"type": "boolean"},
        },
        "required": ["city", "days", "rain"],
        "additionalProperties": False,
    }
    outputs = llm.generate(PROMPTS * 2, [_constrained(seed, 128, json=schema) for seed in range(8)])
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)


def test_unconstrained_requests_get_the_tokens_they_get_alone(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = [output.outputs[0].token_ids for output in llm.generate(PROMPTS[:2], [greedy, seeded])]
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
        [greedy, _constrained(1, regex=REGEX), seeded, _constrained(2, choice=CHOICES)],
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)
    assert mixed[3].outputs[0].text in CHOICES


def test_masks_filled_during_the_forward_pass_give_the_same_tokens(tiny_llama: Path, llm: LLM) -> None:
    """With an accelerator the masks are filled on a thread while the model runs. Run that way on the CPU, a
    batch of grammars, token rules and free rows gets the tokens it gets with the masks filled at sampling."""
    params = [
        _constrained(1, regex=REGEX),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, bad_words=["the"]),
        _constrained(2, choice=CHOICES),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    at_sampling = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    overlapping = LLM(
        str(tiny_llama), dtype="float32", num_gpu_blocks_override=128, block_size=8, max_model_len=256
    )
    overlapping.llm_engine.runner.sampler.grammar_masks = GrammarMasks(fill_during_forward=True)
    during_forward = [output.outputs[0].token_ids for output in overlapping.generate(PROMPTS, params)]
    assert any(thread.name.startswith("grammar-masks") for thread in threading.enumerate())
    assert during_forward == at_sampling


def test_raw_logprobs_are_the_models_within_the_grammar(llm: LLM, tiny_llama: Path) -> None:
    """As vLLM's, which masks a grammar's tokens before sampling: a constrained request's raw logprobs are
    the model's renormalised over what its grammar allows. With a choice of words, the first token's are
    Transformers' log-softmax over the tokens that begin one of them, and no other token scores."""
    choices = ["red", "green", "blue"]
    top = 20
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        logprobs=top,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    (output,) = llm.generate([PROMPTS[0]], params)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([output.prompt_token_ids])).logits[0, -1]
    beginnings = [t for t in range(len(logits)) if _begins_one(tokenizer.decode([t]), choices)]
    assert 1 < len(beginnings) < top
    within = torch.full_like(logits, float("-inf"))
    within[beginnings] = logits[beginnings]
    expected = torch.log_softmax(within, dim=-1)
    (entry,) = output.outputs[0].logprobs or []
    scored = {token: value for token, value in entry.items() if value > float("-inf")}
    assert sorted(scored) == beginnings
    assert scored == pytest.approx({token: expected[token].item() for token in beginnings}, abs=1e-4)


def _begins_one(text: str, choices: list[str]) -> bool:
    return bool(text) and any(choice.startswith(text) for choice in choices)


def test_an_unenforceable_schema_is_refused_before_anything_runs(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}
    with pytest.raises(ValueError, match="'not'"):
        llm.generate(PROMPTS[:2], [_constrained(0, regex=REGEX), _constrained(1, json=schema)])
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_bad_grammar_fails_its_request_alone(llm: LLM) -> None:
    outputs = llm.generate(
        PROMPTS[:3],
        [
            _constrained(0, regex=REGEX),
            _constrained(0, grammar="root ::= undefined_rule"),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].token_ids == []
    assert re.fullmatch(REGEX, outputs[0].outputs[0].text)
    assert outputs[2].outputs[0].finish_reason == "length"
    assert len(outputs[2].outputs[0].token_ids) == 5


def test_the_core_answers_a_grammar_that_fails_to_compile_with_an_invalid_error(tiny_llama: Path) -> None:
    """Through the wire format the API servers use; the other request runs on."""
    core = EngineCore(
        EngineConfig(model=str(tiny_llama), num_gpu_blocks_override=64, max_model_len=256, dtype="float32")
    )
    encoder, decoder = msgspec.msgpack.Encoder(), to_core_decoder()
    for request_id, structured in (
        ("bad", StructuredOutputsParams(grammar='root ::= "a" undefined')),
        (
            "good",
            StructuredOutputsParams(json={"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
        ),
    ):
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=64, structured_outputs=structured)
        add = AddRequest(request_id, [5, 6, 7], params, eos_token_id=4, arrival_time=0.0)
        received = decoder.decode(encoder.encode(add))
        assert received.sampling_params.structured_outputs == structured
        core.add_request(received)
    tokens: list[int] = []
    errors = {}
    while core.has_unfinished_requests():
        step = core.step()
        tokens += [t for output in step.outputs if output.request_id == "good" for t in output.new_token_ids]
        errors.update({error.request_id: (error.kind, error.message) for error in step.errors})
    assert list(errors) == ["bad"]
    kind, message = errors["bad"]
    assert kind == "invalid" and message.startswith("invalid grammar:") and "undefined" in message
    assert tokens[-1] == 4
    assert isinstance(json.loads(AutoTokenizer.from_pretrained(tiny_llama).decode(tokens[:-1])), list)


def test_max_tokens_inside_the_grammar_finishes_with_length(llm: LLM) -> None:
    # Any number of "ab" pairs: the output can never end before max_tokens.
    outputs = llm.generate(PROMPTS[:2], [_constrained(seed, 6, regex="(ab)+c") for seed in range(2)])
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == 6
        assert re.fullmatch(r"(ab)*a?", completion.text), completion.text


def test_preempted_requests_resume_their_grammar(tiny_llama: Path, llm: LLM) -> None:
    """With a cache too small for all of them, requests are preempted and recomputed; seeded, each gives
    the output it gives with room to spare, so its grammar state survived the preemptions."""
    params = [_constrained(seed, 110, regex=LONG_REGEX) for seed in range(6)]
    roomy = [output.outputs[0].text for output in llm.generate(PROMPTS[:3] * 2, params)]
    cramped_llm = LLM(
        str(tiny_llama), dtype="float32", num_gpu_blocks_override=16, block_size=8, max_model_len=128
    )
    cramped = cramped_llm.generate(PROMPTS[:3] * 2, params)
    assert cramped_llm.llm_engine.stats.num_preempted_total > 0
    assert [output.outputs[0].text for output in cramped] == roomy
    assert all(re.fullmatch(LONG_REGEX, text) for text in roomy)


def test_a_request_whose_grammar_compiles_waits_without_blocking_others() -> None:
    scheduler = Scheduler(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8, num_kv_blocks=32
    )
    compiled: Future = Future()
    constrained = Request("constrained", [1, 2, 3], SamplingParams(), grammar=RequestGrammar(compiled))
    plain = Request("plain", [4, 5, 6], SamplingParams())
    scheduler.add_request(constrained)
    scheduler.add_request(plain)
    first = scheduler.schedule()
    assert [request.request_id for request in first.requests] == ["plain"]
    assert scheduler.waiting.peek() is constrained
    compiled.set_result(object())
    second = scheduler.schedule()
    assert [request.request_id for request in second.requests] == ["constrained"]


def test_a_compiling_request_displaces_nobody() -> None:
    """Under the priority policy a more urgent request takes a running one's place, but not before its
    grammar has compiled."""
    scheduler = Scheduler(
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=8,
        num_kv_blocks=32,
        policy="priority",
    )
    running = Request("running", [1, 2, 3], SamplingParams(max_tokens=30), priority=3)
    scheduler.add_request(running)
    assert [r.request_id for r in scheduler.schedule().requests] == ["running"]
    compiled: Future = Future()
    urgent = Request("urgent", [4, 5, 6], SamplingParams(), priority=0, grammar=RequestGrammar(compiled))
    scheduler.add_request(urgent)
    running.append_output_token_ids(7)
    assert scheduler.schedule().preempted_request_ids == set()
    compiled.set_result(object())
    running.append_output_token_ids(8)
    assert scheduler.schedule().preempted_request_ids == {"running"}


def _compile_servers() -> set[int]:
    """The pids of this process's grammar compile servers."""
    return _compilers(child_processes(os.getpid()))


def _compile_processes() -> set[int]:
    """The pids of the compile processes those servers forked (not the short-lived commands a library may
    run as it is imported)."""
    return _compilers(pid for server in _compile_servers() for pid in child_processes(server))


def _compilers(pids: Iterable[int]) -> set[int]:
    return {pid for pid in pids if COMPILE_WORKER_MODULE in _read(Path(f"/proc/{pid}/cmdline"))}


def _tasks(pid: str) -> list[Path]:
    """A process's threads' folders; none once it is gone."""
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _exited(pid: int) -> bool:
    """Whether the process has exited: gone, or a zombie its new parent has not reaped, once its other
    threads have ended too (a pidfd turns readable only then)."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    return not stat or (stat.rsplit(")", 1)[1].split()[0] == "Z" and len(_tasks(str(pid))) <= 1)


def _new_compile_process(known: set[int], timeout: float = 60.0) -> int:
    """The pid of a compile process not among `known`, once one has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = _compile_processes() - known
        if new:
            (pid,) = new
            return pid
        time.sleep(0.05)
    raise TimeoutError("no compile process started")


def test_a_compile_process_that_dies_fails_only_its_grammar(tiny_llama: Path) -> None:
    """A compile process killed (a crash, the OOM killer) fails the grammar it was compiling with a message
    saying so; the next grammar gets a new process, forked from the same compile server, and compiles. A
    compile server killed is started again for the next grammar."""
    vocab_size = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(str(tiny_llama), vocab_size, timeout=120)
    try:
        # Many seconds of compiling (see _slow_to_compile in the server tests).
        pattern = {"type": "string", "pattern": "^([a-z]{1,30}-){1500}$"}
        others, other_servers = _compile_processes(), _compile_servers()  # other engines' in this process
        dying = compiler.compile(StructuredOutputsParams(json=pattern))
        killed = _new_compile_process(others)
        (server,) = _compile_servers() - other_servers
        os.kill(killed, signal.SIGKILL)
        assert dying.exception(timeout=60) is not None
        error = RequestGrammar(dying).error
        assert error is not None and "killed by SIGKILL" in str(error), error
        assert compiler.compile(StructuredOutputsParams(regex="after-[0-9]")).result(timeout=60)
        (forked,) = _compile_processes() - others
        assert forked != killed and _compile_servers() - other_servers == {server}
        # The server killed, and with it the idle compile process, which no server can report on.
        os.kill(server, signal.SIGKILL)
        os.kill(forked, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _exited(forked):
            assert time.monotonic() < deadline, "the killed compile process is still running"
            time.sleep(0.01)
        assert compiler.compile(StructuredOutputsParams(regex="restarted-[0-9]")).result(timeout=60)
        (restarted,) = _compile_servers() - other_servers
        assert restarted != server
    finally:
        compiler.shutdown()
