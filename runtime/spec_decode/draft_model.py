"""Draft-model proposing: a smaller model with the target's tokenizer, run in the same process on a KV cache
of its own, proposes its greedy continuation.

Greedy drafts are a deterministic function of the context, which keeps rejection sampling exact with the
proposal distribution taken as certain (see the sampler). A request's draft KV covers a prefix of its tokens:
when it next speculates, the draft first runs the tokens it has not seen (its whole prompt, the first time),
then one token per further draft. Draft tokens that the target rejected drop out of that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.runtime.core.outputs import SchedulerOutput
from kvfleet.runtime.request import Request
from kvfleet.runtime.speculative_config import SpeculativeConfig
from kvfleet.runtime.worker.model_runner import ModelRunner


@dataclass
class _DraftState:
    request: Request
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Leading tokens of request.all_token_ids whose draft KV is in the cache.
    num_computed_tokens: int = 0
    # Draft tokens whose KV follows them; they stay valid as far as the target accepted them.
    fed_drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        engine_config: EngineConfig,
        num_blocks: int,
        *,
        target_max_model_len: int,
        target_vocab_size: int,
    ) -> None:
        assert config.model is not None
        draft_config = engine_config.replace(
            model=config.model,
            tokenizer=None,
            max_model_len=None,
            enable_lora=False,
            speculative_config=None,
        )
        self.runner = ModelRunner(draft_config)
        if self.runner.max_model_len < target_max_model_len:
            raise ValueError(
                f"speculative_config.model supports {self.runner.max_model_len} tokens of context, less than "
                f"the target's max_model_len ({target_max_model_len})"
            )
        self.runner.load_model()
        self.runner.initialize_kv_cache(num_blocks)
        self.block_size = self.runner.block_size
        self.block_pool = BlockPool(num_blocks, enable_caching=False)
        self.target_vocab_size = target_vocab_size
        self._states: dict[str, _DraftState] = {}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        self._forget_finished()
        drafting: list[_DraftState] = []
        limits: list[int] = []
        for request, limit in zip(requests, num_tokens, strict=True):
            state = self._states.setdefault(request.request_id, _DraftState(request))
            self._keep_accepted(state)
            # Slots for the unseen tokens and for every draft but the last, which is never fed.
            if self._allocate(state, request.num_tokens + limit - 1):
                drafting.append(state)
                limits.append(limit)
        drafts: dict[str, list[int]] = {state.request.request_id: [] for state in drafting}
        if not drafting:
            return [[] for _ in requests]
        # First pass: every unseen token, then the first draft token comes out.
        self._extend(drafting, drafts, [s.request.num_tokens - s.num_computed_tokens for s in drafting])
        for position in range(1, max(limits)):
            going_on = [state for state, limit in zip(drafting, limits, strict=True) if limit > position]
            self._extend(going_on, drafts, [1] * len(going_on))
        for state, limit in zip(drafting, limits, strict=True):
            state.num_computed_tokens = state.request.num_tokens
            state.fed_drafts = drafts[state.request.request_id][: limit - 1]
        return [drafts.get(request.request_id, []) for request in requests]

    def _extend(self, states: list[_DraftState], drafts: dict[str, list[int]], num_new: list[int]) -> None:
        """Feed each request's next num_new tokens of (its tokens + its drafts so far) and append the draft
        model's next token to its drafts."""
        requests = [state.request for state in states]
        computed = [
            state.request.num_tokens + len(drafts[state.request.request_id]) - count
            for state, count in zip(states, num_new, strict=True)
        ]
        step = SchedulerOutput(
            requests=requests,
            num_scheduled_tokens=num_new,
            num_computed_tokens=computed,
            block_ids=[state.block_ids for state in states],
            total_num_scheduled_tokens=sum(num_new),
            scheduled_spec_decode_tokens={
                r.request_id: drafts[r.request_id] for r in requests if drafts[r.request_id]
            },
        )
        for request, token in zip(
            requests, self.runner.greedy_last_tokens(step, self.target_vocab_size), strict=True
        ):
            drafts[request.request_id].append(token)

    def _keep_accepted(self, state: _DraftState) -> None:
        tokens = state.request.all_token_ids
        start = state.num_computed_tokens
        accepted = 0
        for draft in state.fed_drafts:
            if start + accepted >= len(tokens) or tokens[start + accepted] != draft:
                break
            accepted += 1
        # The last token always runs again, so that its logits give the first draft.
        state.num_computed_tokens = min(start + accepted, len(tokens) - 1)
        state.fed_drafts = []

    def _allocate(self, state: _DraftState, num_tokens: int) -> bool:
        """Blocks for the first num_tokens positions; without enough free blocks, the request's draft cache
        is dropped (it runs again from its prompt later) and it does not speculate this step."""
        num_required = -(-num_tokens // self.block_size) - len(state.blocks)
        if num_required <= 0:
            return True
        if num_required > self.block_pool.get_num_free_blocks():
            self._drop(state)
            return False
        new_blocks = self.block_pool.get_new_blocks(num_required)
        state.blocks.extend(new_blocks)
        state.block_ids.extend(block.block_id for block in new_blocks)
        return True

    def _forget_finished(self) -> None:
        for state in [state for state in self._states.values() if state.request.is_finished]:
            self._drop(state)

    def _drop(self, state: _DraftState) -> None:
        self.block_pool.free_blocks(state.blocks)
        del self._states[state.request.request_id]
