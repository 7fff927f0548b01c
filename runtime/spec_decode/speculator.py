"""Which requests speculate in a step, and how many draft tokens each may verify."""

from __future__ import annotations

from typing import Protocol

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.request import Request, RequestStatus
from kvfleet.runtime.spec_decode.draft_model import DraftModelProposer
from kvfleet.runtime.spec_decode.ngram import NgramProposer
from kvfleet.runtime.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Per request, at most its num_tokens draft tokens to follow its all_token_ids (maybe none)."""
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Set the draft tokens of the running requests that decode; those of requests with a grammar stop
        before the first token it forbids. A large batch does not speculate at all."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        candidates: list[Request] = []
        num_tokens: list[int] = []
        for request in running:
            if (
                request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != request.num_tokens - 1
            ):
                continue
            # Tokens past max_model_len or max_tokens would be cut off anyway: not worth verifying.
            room = self.max_model_len - request.num_tokens
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - 1)
            if room > 0:
                candidates.append(request)
                num_tokens.append(min(room, self.config.num_speculative_tokens))
        if candidates:
            proposals = self.proposer.propose(candidates, num_tokens)
            for request, drafts in zip(candidates, proposals, strict=True):
                grammar = request.grammar
                request.spec_token_ids = drafts if grammar is None else grammar.allowed_prefix(drafts)


def make_proposer(
    config: SpeculativeConfig,
    engine_config: EngineConfig,
    num_kv_blocks: int,
    *,
    max_model_len: int,
    vocab_size: int,
) -> Proposer:
    """num_kv_blocks, max_model_len, vocab_size: the target's; a draft model gets as many blocks (of its own,
    smaller size), and must reach as far."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return DraftModelProposer(
        config, engine_config, num_kv_blocks, target_max_model_len=max_model_len, target_vocab_size=vocab_size
    )
