"""logit_bias, allowed_token_ids and bad_words in the engine, against what the tokenizer says of the words."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.messages import AddRequest
from kvfleet.runtime.structured_outputs.token_rules import TokenRules
from transformers import AutoTokenizer

PROMPTS = ["The weather today", "Write a list:", "1 2 3"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=128, block_size=8, max_model_len=256)


def _tokens(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]


def _greedy(max_tokens: int = 16, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_logit_bias_pulls_and_pushes_tokens(llm: LLM) -> None:
    (plain,) = _tokens(llm, PROMPTS[:1], [_greedy()])
    (pulled,) = _tokens(llm, PROMPTS[:1], [_greedy(logit_bias={42: 100.0})])
    assert pulled == [42] * 16
    (pushed,) = _tokens(llm, PROMPTS[:1], [_greedy(logit_bias={plain[0]: -100.0})])
    assert pushed[0] != plain[0]


def test_allowed_token_ids_are_the_only_ones_sampled(llm: LLM) -> None:
    allowed = [10, 20, 30, 40, 300]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=24, allowed_token_ids=allowed)
        for seed in range(3)
    ]
    for tokens in _tokens(llm, PROMPTS, params):
        assert tokens and set(tokens) <= set(allowed)


def test_bad_words_never_appear(llm: LLM, tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    plain = _tokens(llm, PROMPTS, [_greedy(max_tokens=40)] * 3)
    # Words the model says when left alone; at least one is several tokens long.
    words = sorted({w for tokens in plain for w in tokenizer.decode(tokens).split() if w.isalpha()}, key=len)[
        -4:
    ]
    assert any(len(tokenizer.encode(" " + w, add_special_tokens=False)) > 1 for w in words)
    banned = _tokens(llm, PROMPTS, [_greedy(max_tokens=40, bad_words=words)] * 3)
    assert banned != plain
    for tokens in banned:
        for word in words:
            for text in (word, " " + word):
                sequence = tokenizer.encode(text, add_special_tokens=False)
                windows = [tokens[i : i + len(sequence)] for i in range(len(tokens) - len(sequence) + 1)]
                assert sequence not in windows, (word, tokenizer.decode(tokens))


def test_a_bad_word_is_banned_after_a_space_and_without_one_however_given(tiny_llama: Path) -> None:
    """The token sequences a bad word bans are the tokenizer's of the word at the output's start and after
    a space, whether the word is given with a leading space or not."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    forms = {tuple(tokenize("weather")), tuple(tokenize(" weather"))}
    assert len(forms) == 2
    for given in ("weather", " weather", "  weather"):
        rules = TokenRules.of(SamplingParams(bad_words=[given]), tokenizer.vocab_size, tokenize)
        assert rules is not None and set(rules.bad_sequences) == forms


def test_unconstrained_rows_are_untouched_by_their_neighbours_rules(llm: LLM) -> None:
    alone = _tokens(llm, PROMPTS[:2], [_greedy(), SamplingParams(temperature=0.9, seed=4, max_tokens=16)])
    mixed = _tokens(
        llm,
        [PROMPTS[0], PROMPTS[2], PROMPTS[1]],
        [
            _greedy(),
            _greedy(logit_bias={7: 50.0}, bad_words=["the"], allowed_token_ids=[7, 8, 9]),
            SamplingParams(temperature=0.9, seed=4, max_tokens=16),
        ],
    )
    assert [mixed[0], mixed[2]] == alone


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM, tiny_llama: Path) -> None:
    for params in (_greedy(logit_bias={10**6: 1.0}), _greedy(allowed_token_ids=[1, 10**6])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(PROMPTS[:2], [_greedy(max_tokens=3), params])
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine core refuses them too, alone, when a front end lets them through.
    core = llm.llm_engine.engine_core
    core.add_request(AddRequest("far", [5, 6], _greedy(logit_bias={10**6: 1.0}), None, 0.0))
    core.add_request(AddRequest("near", [5, 6], _greedy(max_tokens=3), None, 0.0))
    errors, tokens = {}, []
    while core.has_unfinished_requests():
        step = core.step()
        errors.update({error.request_id: error.kind for error in step.errors})
        tokens += [t for output in step.outputs for t in output.new_token_ids]
    assert errors == {"far": "invalid"}
    assert len(tokens) == 3
