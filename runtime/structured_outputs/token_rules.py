"""One request's token rules besides its grammar: logit_bias, allowed_token_ids and bad_words, applied in the
same pass as the grammars' masks (masks.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_outputs.bitmasks import pack_bits


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
            # A word reads differently at the start of the output and after a space (vLLM bans both).
            for text in (word, " " + word.lstrip()):
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
