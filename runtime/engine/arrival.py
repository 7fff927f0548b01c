"""What the engine core does with a request when it arrives, before the scheduler queues it: handlers with one
job each, built with the core for the features its config and model have, and asked in turn.

A handler checks the request, refusing it with an InvalidRequestError (or EngineOverloadedError), or
prepares a part of it: its token rules, its adapter, its prefix-cache salt, its M-RoPE positions, its part
in disaggregated prefill and decode, its grammar. They run after the prompt's own check, in the order the
core registers them: the grammar's compile last, so that a request refused by another handler starts none.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sized
from typing import Any, Protocol

from kvfleet.contract.kv_transfer import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, REMOTE_BLOCK_IDS
from kvfleet.contract.precedence import QueuedRequest, choose_victim
from kvfleet.runtime.engine.grammar_compiler import GrammarCompiler, RequestGrammar
from kvfleet.runtime.engine.messages import AddRequest, RequestError
from kvfleet.runtime.errors import EngineOverloadedError, InvalidContinuationError, InvalidRequestError
from kvfleet.runtime.input_checks import check_sampling_token_ids
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.params import (
    RemoteDecode,
    RemotePrefill,
    check_peer,
    parse_kv_transfer_params,
)
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.rope import rope_cache_salt
from kvfleet.runtime.multimodal.inputs import ModalitySpec, check_features
from kvfleet.runtime.multimodal.mrope import MRopePositions
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import KV_TRANSFER_PARAMS
from kvfleet.runtime.structured_outputs.token_rules import TokenRules

# With nothing to run but grammars compiling, a step waits this long for one of them instead of spinning.
_GRAMMAR_WAIT_S = 0.01


class ArrivalHandler(Protocol):
    def prepare(self, add: AddRequest, request: Request) -> None:
        """Check the request or fill in its part of it; raises an EngineError to refuse it."""
        ...


class WaitingLimit:
    """Under --max-waiting-requests, a request that finds the queue full sheds a waiting request of a lower
    tier (see kvfleet.contract.precedence), or is refused."""

    def __init__(
        self,
        limit: int,
        waiting: Sized,
        unstarted: Mapping[str, AddRequest],
        shed: Callable[[str], None],
    ) -> None:
        """`unstarted`: the queued requests never scheduled yet, the only ones that may be shed."""
        self._limit = limit
        self._waiting = waiting
        self._unstarted = unstarted
        self._shed = shed

    def prepare(self, add: AddRequest, request: Request) -> None:
        if len(self._waiting) < self._limit:
            return
        queued = [QueuedRequest(a.request_id, a.priority, a.arrival_time) for a in self._unstarted.values()]
        victim = choose_victim(queued, add.priority)
        if victim is None:
            raise EngineOverloadedError(f"the server is overloaded: {self._limit} requests are waiting")
        self._shed(victim)


class SamplingTokenRules:
    """logit_bias, allowed_token_ids and bad_words: checked against the vocabulary, then turned into the
    request's token rules."""

    def __init__(self, vocab_size: int, tokenize: Callable[[str], list[int]]) -> None:
        self._vocab_size = vocab_size
        self._tokenize = tokenize

    def prepare(self, add: AddRequest, request: Request) -> None:
        params = add.sampling_params
        check_sampling_token_ids(params, vocab_size=self._vocab_size)
        request.token_rules = TokenRules.of(params, self._vocab_size, self._tokenize)


class LoRAAdapters:
    """The adapters requests run with: loaded when a request brings one, and dropped from the model runner
    once their API server unloaded them and no request runs with them. Without LoRA (no `load`), a request
    with an adapter is refused."""

    def __init__(self, load: Callable[[LoRARequest], None] | None) -> None:
        """`load`: has an adapter ready to run (Executor.add_lora)."""
        self._load = load
        self._removals: set[int] = set()

    def prepare(self, add: AddRequest, request: Request) -> None:
        if add.lora_request is not None:
            self.add(add.lora_request)

    def add(self, lora: LoRARequest) -> None:
        """Have the adapter ready to run; raises InvalidRequestError when it cannot run on this model."""
        if self._load is None:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled")
        try:
            self._load(lora)
        except LoRAAdapterError as error:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r}: {error}") from None
        # Loaded again (the same files under a name) before its removal was done.
        self._removals.discard(lora.lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        self._removals.add(lora_int_id)

    def take_removals(self, requests: Mapping[str, Request]) -> list[int]:
        """The unloaded adapters no request of `requests` runs with any more, now forgotten here."""
        if not self._removals:
            return []
        in_use = {request.lora_int_id for request in requests.values()}
        done = sorted(self._removals - in_use)
        self._removals.difference_update(done)
        return done


class MediaItems:
    """The prompt's images and audio clips must be of a modality the model takes (none, for a text model), of
    its input shape, on their placeholder tokens, and each fit in a step's encoder budget; prompt embeddings,
    where the engine takes them (`prompt_embeds_size`, the model's hidden size), of the prompt's shape."""

    def __init__(
        self, modalities: Mapping[str, ModalitySpec], max_item_tokens: int, prompt_embeds_size: int | None
    ) -> None:
        self._modalities = modalities
        self._max_item_tokens = max_item_tokens
        self._prompt_embeds_size = prompt_embeds_size

    def prepare(self, add: AddRequest, request: Request) -> None:
        if not self._modalities and not add.mm_features:
            return
        try:
            check_features(
                add.prompt_token_ids,
                add.mm_features,
                self._modalities,
                max_item_tokens=self._max_item_tokens,
                prompt_embeds_size=self._prompt_embeds_size,
            )
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None


class RopeCacheSalt:
    """With a length-dependent rope type, a long prompt's KV differs from a shorter one's for the same tokens:
    its salt keeps their prefix-cache blocks apart."""

    def __init__(self, rope: dict[str, Any]) -> None:
        self._rope = rope

    def prepare(self, add: AddRequest, request: Request) -> None:
        request.model_salt = rope_cache_salt(self._rope, len(add.prompt_token_ids))


class PromptMRopePositions:
    """On a model with M-RoPE, the three-dimensional positions of the request's prompt."""

    def __init__(self, modalities: Mapping[str, ModalitySpec]) -> None:
        self._modalities = modalities

    def prepare(self, add: AddRequest, request: Request) -> None:
        num_prompt_tokens = len(add.prompt_token_ids)
        request.mrope_positions = MRopePositions.of(num_prompt_tokens, add.mm_features, self._modalities)


class KVTransferParams:
    """A request's kv_transfer_params (SamplingParams.extra_args["kv_transfer_params"]): well formed, a call
    this replica's role takes, one sequence, and for a decode call blocks for exactly its prompt on a peer in
    this replica's networks. Without kv_transfer_config (None) a request asking for a transfer is refused."""

    def __init__(self, config: KVTransferConfig | None, block_size: int) -> None:
        self._config = config
        self._block_size = block_size

    def prepare(self, add: AddRequest, request: Request) -> None:
        extra_args = add.sampling_params.extra_args or {}
        if KV_TRANSFER_PARAMS not in extra_args:
            return
        call = parse_kv_transfer_params(extra_args[KV_TRANSFER_PARAMS])
        if call is None:
            return
        config = self._config
        if config is None:
            raise InvalidRequestError(
                "kv_transfer_params: this replica takes no part in disaggregated prefill and decode (it was "
                "started without --kv-transfer-config)"
            )
        if add.sampling_params.n > 1:
            raise InvalidRequestError(
                "kv_transfer_params: a disaggregated request generates one sequence (n=1)"
            )
        if isinstance(call, RemoteDecode) and not config.is_producer:
            raise InvalidRequestError(
                f"kv_transfer_params.{DO_REMOTE_DECODE}: this replica's role is {config.kv_role}, which "
                "takes no prefill calls"
            )
        if isinstance(call, RemotePrefill):
            if not config.is_consumer:
                raise InvalidRequestError(
                    f"kv_transfer_params.{DO_REMOTE_PREFILL}: this replica's role is {config.kv_role}, which "
                    "takes no decode calls"
                )
            num_blocks = -(-len(add.prompt_token_ids) // self._block_size)
            if len(call.block_ids) != num_blocks:
                raise InvalidRequestError(
                    f"kv_transfer_params.{REMOTE_BLOCK_IDS} names {len(call.block_ids)} blocks; the prompt "
                    f"of {len(add.prompt_token_ids)} tokens takes {num_blocks} blocks of {self._block_size}"
                )
            check_peer(call, config.peer_networks)
        request.kv_transfer = call


class PromptHiddenStates:
    """A request for its prompt's hidden state is served where the whole model runs in the core's process:
    ranks in worker processes send back only their logits."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    def prepare(self, add: AddRequest, request: Request) -> None:
        if add.sampling_params.prompt_pooling is not None and self._world_size > 1:
            raise InvalidRequestError(
                f"a prompt's hidden state (an embedding) is served by a single-rank engine, not by one of "
                f"{self._world_size} ranks"
            )


class PromptLogprobs:
    """A request for its prompt's logprobs is served where the engine computes its whole prompt: ranks in
    worker processes send back only their logits, and a decode call's prompt was computed on a prefill
    replica."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    def prepare(self, add: AddRequest, request: Request) -> None:
        if add.sampling_params.prompt_logprobs is None:
            return
        if self._world_size > 1:
            raise InvalidRequestError(
                f"prompt_logprobs are served by a single-rank engine, not by one of {self._world_size} ranks"
            )
        if request.kv_transfer is not None:
            raise InvalidRequestError(
                "prompt_logprobs: a disaggregated request's prompt is computed on its prefill replica"
            )


class StructuredOutputs:
    """Starts compiling a request's grammar when it arrives; the request waits in the queue meanwhile (the
    scheduler's GrammarReady gate). Each step then settles the compiles that ended: a request whose grammar
    failed is finished alone, with the error."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        # Requests whose grammar was still compiling when they arrived.
        self._compiling: dict[str, Request] = {}

    def prepare(self, add: AddRequest, request: Request) -> None:
        structured = add.sampling_params.structured_outputs
        if structured is None:
            return
        end_token_ids = [request.eos_token_id] if request.eos_token_id is not None else []
        end_token_ids += [token_id for token_id in request.stop_token_id_set if token_id not in end_token_ids]
        grammar = RequestGrammar(
            self.compiler.compile(structured),
            end_token_ids=end_token_ids,
            resumed=bool(request.output_token_ids),
        )
        request.grammar = grammar
        if grammar.compiled_ok and not grammar.ready:
            grammar.catch_up(request.output_token_ids)  # refused now if its output does not follow
        if not grammar.ready:
            self._compiling[request.request_id] = request

    def settle(self) -> list[RequestError]:
        """Forget the requests whose grammar compiled or that ended otherwise (refused, aborted), a
        continuation's grammar caught up with its output; the errors of those whose grammar failed to
        compile or refuses their output, for the core to finish them with."""
        failed = []
        for request_id, request in list(self._compiling.items()):
            grammar = request.grammar
            assert grammar is not None
            if request.is_finished:
                del self._compiling[request_id]
            elif grammar.compiled_ok:
                del self._compiling[request_id]
                if grammar.ready:
                    continue
                try:
                    grammar.catch_up(request.output_token_ids)
                except InvalidContinuationError as error:
                    failed.append(RequestError(request_id, error.kind, str(error)))
            elif grammar.error is not None:
                del self._compiling[request_id]
                failed.append(RequestError(request_id, grammar.error.kind, str(grammar.error)))
        return failed

    def wait_for_one(self) -> None:
        """In a step that had nothing to run, wait a little for a compile to end instead of spinning."""
        if self._compiling:
            concurrent.futures.wait(
                [request.grammar.compiled for request in self._compiling.values() if request.grammar],
                timeout=_GRAMMAR_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
