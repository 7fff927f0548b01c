"""One request's token rules besides its grammar: allowed_token_ids, bad_words and logit_bias, applied as
vLLM's first logits processors: after the raw logprobs are taken, before the penalties."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_outputs.bitmasks import apply_bitmask, bitmask_width, clear_bits, pack_bits

if TYPE_CHECKING:
    from kvfleet.runtime.request import Request


@dataclass(frozen=True)
class TokenRules:
    # A bitmask row of the tokens allowed_token_ids lets through, or None for all of them.
    allowed: torch.Tensor | None
    # Token sequences of the bad words: the last token of one is banned where the output ends with the rest.
    bad_sequences: tuple[tuple[int, ...], ...]
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None

    @property
    def masks(self) -> bool:
        """Whether the rules take tokens out (logit_bias only shifts them)."""
        return self.allowed is not None or bool(self.bad_sequences)

    def banned(self, output_token_ids: list[int]) -> list[int]:
        """The tokens the bad words forbid next, after this output."""
        banned = []
        for sequence in self.bad_sequences:
            prefix = sequence[:-1]
            if not prefix or tuple(output_token_ids[-len(prefix) :]) == prefix:
                banned.append(sequence[-1])
        return banned

    @classmethod
    def of(
        cls, params: SamplingParams, vocab_size: int, tokenize: Callable[[str], list[int]]
    ) -> TokenRules | None:
        """A request's rules, or None when it has none. `tokenize` encodes text without special tokens."""
        allowed = None
        if params.allowed_token_ids is not None:
            keep = torch.zeros(vocab_size, dtype=torch.bool)
            keep[params.allowed_token_ids] = True
            allowed = pack_bits(keep)
        bad_sequences = set()
        for word in params.bad_words or ():
            # A word reads differently at the start of the output and after a space: both are banned, however
            # the word is given (vLLM's start form is the word without its leading spaces too).
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = tuple(tokenize(text))
                if token_ids:
                    bad_sequences.add(token_ids)
        bias_token_ids = bias_values = None
        if params.logit_bias:
            bias_token_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if allowed is None and not bad_sequences and bias_token_ids is None:
            return None
        return cls(allowed, tuple(sorted(bad_sequences)), bias_token_ids, bias_values)


def apply_token_rules(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """logits: [len(requests), vocab], modified in place: tokens a row's allowed_token_ids or bad_words forbid
    get -inf, then its logit_bias is added."""
    rule_rows = [row for row, request in enumerate(requests) if request.token_rules is not None]
    if not rule_rows:
        return
    masked = []
    bitmask = torch.full((len(requests), bitmask_width(logits.shape[1])), -1, dtype=torch.int32)
    for row in rule_rows:
        request = requests[row]
        rules = request.token_rules
        assert rules is not None
        if rules.masks:
            if rules.allowed is not None:
                bitmask[row] = rules.allowed
            clear_bits(bitmask[row], rules.banned(request.output_token_ids))
            masked.append(row)
    if masked:
        apply_bitmask(logits, bitmask, masked)
    for row in rule_rows:
        rules = requests[row].token_rules
        assert rules is not None
        if rules.bias_token_ids is not None and rules.bias_values is not None:
            ids = rules.bias_token_ids.to(logits.device)
            logits[row].index_add_(0, ids, rules.bias_values.to(logits.device, logits.dtype))
