"""Offline inference: `LLM(model=PATH).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from kvfleet.runtime.chat_content_format import ContentFormatOption
from kvfleet.runtime.chat_prompt import chat_prompt_token_ids
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.beam_search import BeamSearch, BeamSearchOutput
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvfleet.runtime.errors import EngineSleepingError, RequestFailedError
from kvfleet.runtime.input_checks import check_cache_salt, check_sampling_token_ids
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature, check_features, prompt_embeds_item
from kvfleet.runtime.pooler_config import EMBED, GENERATE, PoolerConfig, cosine, score_pairs, served_tasks
from kvfleet.runtime.pooling_params import PoolingParams
from kvfleet.runtime.prompt_embeds import prompt_embeds_array
from kvfleet.runtime.sampling_params import BeamSearchParams, SamplingParams
from kvfleet.runtime.structured_outputs.grammars import check_constraint
from tqdm import tqdm

# A text or token-id prompt, or vLLM's dict: {"prompt": text}, {"prompt_token_ids": ids} or, with
# enable_prompt_embeds, {"prompt_embeds": a tensor [tokens, hidden size]}; with "multi_modal_data": {"image":
# a PIL image or a list of them} for a vision model, {"audio": (waveform, sampling rate) or a list of them}
# for an audio model (one placeholder token in the prompt per item), and "cache_salt": a tenant's salt (its
# prompts share prefix-cache blocks only with prompts of the same salt).
Prompt = str | list[int] | dict[str, Any]
ChatMessages = list[dict[str, Any]]
# Whether a progress bar counts the finished prompts, or the tqdm class (or factory) that draws it.
ProgressBar = bool | Callable[..., tqdm]


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        config = EngineConfig(model=model, **engine_options)
        # Read before the engine starts: a generation_config.json with values no request could carry fails
        # here, naming them.
        self._default_sampling = config.sampling_defaults()
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate() and chat() sample with where no SamplingParams are given, those of
        generation_config (the model folder's generation_config.json by default) with
        override_generation_config's over them, else SamplingParams()."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: ProgressBar = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in the order given. `lora_request`: the
        adapter of every prompt, or one per prompt (None for the base model). `use_tqdm`: a progress bar on
        stderr counts the finished prompts, with the input and output tokens per second so far (False for
        none; a callable such as `functools.partial(tqdm, leave=False)` draws it instead of tqdm)."""
        self._check_task(GENERATE, "generate")
        return self._generate(prompts, sampling_params, priority, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: ProgressBar = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's best `params.beam_width` beams (kvfleet.runtime.engine.beam_search), their
        tokens the prompt's and their own, their text all of them decoded. The searches run side by side, a
        step (one token for every live beam) at a time. Text and token-id prompts: a prompt of images, audio
        or embeddings is refused. `use_tqdm`: a progress bar counts the steps."""
        self._check_task(GENERATE, "beam_search")
        prompt_list = _as_prompt_list(prompts)
        lora_list = _broadcast(lora_request, len(prompt_list), "lora_request")
        tokenizer = self.get_tokenizer()
        searches = []
        for prompt in prompt_list:
            if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or "prompt_embeds" in prompt):
                raise ValueError(
                    "beam_search takes text and token-id prompts, not images, audio or embeddings"
                )
            token_ids, _ = self._prepare(prompt)
            self.llm_engine.validate_prompt(token_ids, SamplingParams(max_tokens=params.max_tokens))
            searches.append(BeamSearch(token_ids, params, tokenizer.eos_token_id))
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        with make_bar(total=params.max_tokens, disable=not use_tqdm, desc="Beam search", unit="step") as bar:
            while live := [index for index, search in enumerate(searches) if not search.done]:
                beams = [(index, beam) for index in live for beam in searches[index].beams]
                outputs = self._generate(
                    [{"prompt_token_ids": beam.tokens} for _, beam in beams],
                    searches[live[0]].step_params,
                    None,
                    False,
                    [lora_list[index] for index, _ in beams],
                )
                scored: dict[int, list[dict[int, float]]] = {index: [] for index in live}
                for (index, _), output in zip(beams, outputs, strict=True):
                    scored[index].append(output.outputs[0].logprobs[0])
                for index in live:
                    searches[index].advance(scored[index])
                bar.update(1)
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        use_tqdm: ProgressBar = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding, in the order given, pooled as the folder and pooler_config say
        (kvfleet.runtime.pooler_config), cut and normalized as each prompt's PoolingParams say."""
        self._check_task(EMBED, "embed")
        pooler = self._pooler
        if pooler.refusal is not None:
            raise ValueError(f"embeddings are not served: {pooler.refusal}")
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(pooling_params or PoolingParams(), len(prompt_list), "pooling_params")
        for params in params_list:
            if params.dimensions is not None:
                pooler.check_dimensions(params.dimensions)
        pooled = SamplingParams(temperature=0.0, max_tokens=1, prompt_pooling=pooler.pooling_type)
        outputs = self._generate(prompt_list, pooled, None, use_tqdm, lora_request)
        failed = [index for index, output in enumerate(outputs) if output.prompt_hidden_state is None]
        if failed:
            # A prompt the model failed on has no embedding to give; the log says why.
            reasons = sorted({outputs[index].outputs[0].finish_reason or "unfinished" for index in failed})
            raise RequestFailedError(
                f"the engine failed on prompts {failed} ({', '.join(reasons)}): no embedding"
            )
        return [
            EmbeddingRequestOutput(
                output.request_id,
                output.prompt_token_ids,
                output.finished,
                EmbeddingOutput(
                    pooler.embedding(output.prompt_hidden_state, params.dimensions, params.use_activation)
                ),
            )
            for output, params in zip(outputs, params_list, strict=True)
        ]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        /,
        *,
        use_tqdm: ProgressBar = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's, for an embedding model: the cosine similarity of each pair's embeddings, one of `data_1`
        against each of `data_2` or the two pair by pair."""
        first, second = score_pairs(_as_prompt_list(data_1), _as_prompt_list(data_2))
        outputs = self.embed(
            [*first, *second],
            use_tqdm=use_tqdm,
            pooling_params=pooling_params,
            lora_request=_broadcast(lora_request, len(first), "lora_request") * 2,
        )
        return [
            ScoringRequestOutput(
                f"{one.request_id}_{other.request_id}",
                one.prompt_token_ids + other.prompt_token_ids,
                True,
                ScoringOutput(cosine(one.outputs.embedding, other.outputs.embedding)),
            )
            for one, other in zip(outputs[: len(first)], outputs[len(first) :], strict=True)
        ]

    @cached_property
    def _pooler(self) -> PoolerConfig:
        return self.llm_engine.config.pooler()

    def _check_task(self, task: str, method: str) -> None:
        config = self.llm_engine.config
        if task not in served_tasks(config.runner, config.convert):
            raise ValueError(
                f"{method}() is not served by an engine of runner {config.runner} and convert "
                f"{config.convert}"
            )

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        use_tqdm: ProgressBar,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params_list = _broadcast(params, len(prompt_list), "sampling_params")
        lora_list = _broadcast(lora_request, len(prompt_list), "lora_request")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")

        engine = self.llm_engine
        if engine.is_sleeping():
            raise EngineSleepingError("the engine is asleep: wake_up() first")
        # Validate everything before queueing anything, so bad input leaves the engine untouched.
        prepared = [self._prepare(prompt) for prompt in prompt_list]
        token_lists = [token_ids for token_ids, _ in prepared]
        salts = [prompt.get("cache_salt") if isinstance(prompt, dict) else None for prompt in prompt_list]
        for salt in salts:
            if salt is not None:
                check_cache_salt(salt)
        for token_ids, params in zip(token_lists, params_list, strict=True):
            engine.validate_prompt(token_ids, params)
            check_sampling_token_ids(params, vocab_size=engine.vocab_size)
            if params.structured_outputs is not None:
                check_constraint(params.structured_outputs)
        for lora in {lora for lora in lora_list if lora is not None}:
            engine.engine_core.add_lora(lora)
        ids = [str(next(self._request_counter)) for _ in prompt_list]
        try:
            for request_id, prompt, (token_ids, features), params, prio, lora, salt in zip(
                ids, prompt_list, prepared, params_list, priorities, lora_list, salts, strict=True
            ):
                engine.add_request(
                    request_id,
                    prompt.get("prompt", token_ids) if isinstance(prompt, dict) else prompt,
                    params,
                    priority=prio,
                    prompt_token_ids=token_ids,
                    lora_request=lora,
                    mm_features=features,
                    cache_salt=salt,
                )
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def _prepare(self, prompt: Prompt) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's token ids (placeholders expanded) and its images' and audio clips' features."""
        engine = self.llm_engine
        if not isinstance(prompt, dict):
            return engine.tokenize(prompt), []
        if "prompt_embeds" in prompt:
            token_ids, feature = prompt_embeds_item(prompt_embeds_array(prompt["prompt_embeds"]))
            enabled = engine.config.enable_prompt_embeds
            hidden_size = engine.engine_core.info.hidden_size if enabled else None
            check_features(token_ids, [feature], {}, max_item_tokens=0, prompt_embeds_size=hidden_size)
            return token_ids, [feature]
        if "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
        else:
            token_ids = engine.tokenize(prompt["prompt"])
        data = prompt.get("multi_modal_data") or {}
        items = {modality: value if isinstance(value, list) else [value] for modality, value in data.items()}
        if not any(items.values()):
            return token_ids, []
        return engine.prompt_media.prepare(token_ids, items)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the device's and the host tier's)."""
        self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs enable_sleep_mode=True): level 1 frees the KV cache and keeps the
        weights in host memory, level 2 drops the weights too. generate() raises EngineSleepingError until
        wake_up()."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep freed: "weights", "kv_cache", or both (None); after level 2 the weights are
        read again from the model folder."""
        self.llm_engine.wake_up(tags)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: ProgressBar = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: ContentFormatOption = "auto",
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template_content_format=chat_template_content_format,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        *,
        add_generation_prompt: bool = True,
        chat_template_content_format: ContentFormatOption = "auto",
    ) -> list[int]:
        """The conversation's prompt: the template's markup with its special tokens, message text as text;
        content given as OpenAI's parts goes to the template as `chat_template_content_format` has it (vLLM's
        rules: kvfleet.runtime.chat_content_format)."""
        return chat_prompt_token_ids(
            self.llm_engine.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            content_format=chat_template_content_format,
        )

    def _run(self, ids: list[str], use_tqdm: ProgressBar) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        input_tokens = output_tokens = 0
        with make_bar(
            total=len(ids), disable=not use_tqdm, desc="Processed prompts", unit="prompt", dynamic_ncols=True
        ) as progress:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    results[output.request_id] = output
                    input_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
                    elapsed = progress.format_dict["elapsed"]
                    if elapsed > 0:
                        progress.set_postfix_str(
                            f"est. speed input: {input_tokens / elapsed:.2f} toks/s, "
                            f"output: {output_tokens / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                    progress.update(1)
        return [results[request_id] for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, Sequence):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
