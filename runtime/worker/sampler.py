"""Turns one step's logits into tokens, for a batch of requests with their own sampling parameters.

Order (vLLM's): log probabilities of the raw logits; min_tokens masking of eos and stop ids; repetition,
frequency and presence penalties; greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax; other
rows are divided by their temperature, then filtered by min_p, top_k and top_p, and sampled by inverting
their cumulative distribution at one uniform draw per row (cheaper on a CPU than noise over the whole
vocabulary). A request with a seed draws from its own generator, so its tokens do not depend on what else is
in the batch.
The tokens that structured outputs' grammars forbid are masked after the penalties.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_outputs.masks import GrammarMasks

# Top-p looks for its cut among this many most likely tokens first, and sorts a row only when it is wider.
_TOP_P_CANDIDATES = 256


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: top-N log probabilities plus the sampled token's, or None when the request did not ask.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.grammar_masks = GrammarMasks(fill_during_forward=device.type != "cpu")

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests. Preempted requests keep theirs: when one resumes, its
        random stream continues where it stopped, so its tokens are those of an uninterrupted run."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    def prepare(self, requests: Sequence[Request]) -> None:
        """What can be done for these requests' sampling before their logits exist, started on a thread
        while the model runs on an accelerator: filling their grammars' masks. Pass the same sequence to the
        call."""
        self.grammar_masks.prepare(requests)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: float32 [len(requests), vocab], modified in place."""
        if all(_plain_greedy(r) for r in requests):  # the common case, decided without building anything
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        params = [r.sampling_params for r in requests]
        raw_logprobs = self._raw_logprobs(logits, params)
        self._mask_stop_tokens_before_min_tokens(logits, requests)
        self._apply_penalties(logits, requests)
        self.grammar_masks.apply(logits, requests)
        greedy = [p.greedy for p in params]
        token_ids = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, requests, greedy)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, _gather_logprobs(raw_logprobs, token_ids, token_list, params))

    def _raw_logprobs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
        if all(p.logprobs is None for p in params):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _mask_stop_tokens_before_min_tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows: list[int] = []
        columns: list[int] = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens:
                continue
            stop_ids = set(params.stop_token_ids or ())
            if request.eos_token_id is not None and not params.ignore_eos:
                stop_ids.add(request.eos_token_id)
            vocab_size = logits.shape[1]
            for token_id in stop_ids:
                if token_id < vocab_size:
                    rows.append(row)
                    columns.append(token_id)
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if _has_penalties(r.sampling_params)]
        if not rows:
            return
        device = logits.device
        vocab_size = logits.shape[1]
        selected = [requests[i] for i in rows]
        output_counts = _token_counts([r.output_token_ids for r in selected], vocab_size, device)
        in_prompt = _token_counts([r.prompt_token_ids for r in selected], vocab_size, device) > 0
        index = torch.tensor(rows, device=device)
        sub = logits.index_select(0, index)

        def column(name: str) -> torch.Tensor:
            values = [getattr(r.sampling_params, name) for r in selected]
            return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

        repetition = column("repetition_penalty")
        seen = in_prompt | (output_counts > 0)
        penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalised, sub)
        sub -= column("frequency_penalty") * output_counts
        sub -= column("presence_penalty") * (output_counts > 0).to(sub.dtype)
        logits.index_copy_(0, index, sub)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        params = [r.sampling_params for r in requests]
        greedy_tokens = logits.argmax(dim=-1) if any(greedy) else None
        temperatures = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        if any(t != 1.0 for t in temperatures):
            logits.div_(torch.tensor(temperatures, dtype=logits.dtype, device=device).unsqueeze(1))
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0 and not greedy[i]]
        if min_p_rows:
            _apply_min_p(logits, min_p_rows, [params[i].min_p for i in min_p_rows])
        filter_rows = [i for i, p in enumerate(params) if (p.top_k > 0 or p.top_p < 1.0) and not greedy[i]]
        if filter_rows:
            _apply_top_k_top_p(
                logits,
                filter_rows,
                [params[i].top_k for i in filter_rows],
                [params[i].top_p for i in filter_rows],
            )
        uniform = torch.rand(len(requests), 1, generator=self.generator, device=device)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None and not greedy[row]:
                uniform[row] = torch.rand(1, generator=self._request_generator(request), device=device)
        cumulative = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
        # The first token whose cumulative probability exceeds the draw; zero-probability tokens never are.
        sampled = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
        sampled = sampled.clamp_(max=logits.shape[1] - 1).squeeze(1)
        if greedy_tokens is not None:
            sampled = torch.where(torch.tensor(greedy, device=device), greedy_tokens, sampled)
        return sampled

    def _request_generator(self, request: Request) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_params.seed
            assert seed is not None
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._request_generators[request.request_id] = generator
        return generator


def _plain_greedy(request: Request) -> bool:
    """Greedy with nothing to apply first: no logprobs, penalties, grammar or token rules, and min_tokens
    already reached."""
    params = request.sampling_params
    return (
        params.greedy
        and request.grammar is None
        and request.token_rules is None
        and params.logprobs is None
        and request.num_output_tokens >= params.min_tokens
        and not _has_penalties(params)
    )


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] occurrence counts."""
    longest = max((len(t) for t in token_lists), default=0)
    # Padding goes to an extra column that is dropped afterwards.
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def _apply_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float]) -> None:
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    probs = torch.softmax(sub, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, device=logits.device).unsqueeze(1)
    logits.index_copy_(0, index, sub.masked_fill_(probs < threshold, float("-inf")))


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[int], top_ks: list[int], top_ps: list[float]) -> None:
    """Top-k, then top-p over what is left. Sorting the whole vocabulary is slow on a CPU, so neither does
    unless a row's nucleus is wider than the _TOP_P_CANDIDATES most likely tokens."""
    k_rows = [j for j, k in enumerate(top_ks) if k > 0]
    if k_rows:
        _apply_top_k(logits, [rows[j] for j in k_rows], [top_ks[j] for j in k_rows])
    p_rows = [j for j, p in enumerate(top_ps) if p < 1.0]
    if p_rows:
        _apply_top_p(logits, [rows[j] for j in p_rows], [top_ps[j] for j in p_rows])


def _apply_top_k(logits: torch.Tensor, rows: list[int], top_ks: list[int]) -> None:
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    ks = [min(k, logits.shape[1]) for k in top_ks]
    top_values = sub.topk(max(ks), dim=-1).values
    # Ties with the k-th largest value stay in, as in vLLM.
    kth_largest = top_values.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)
    logits.index_copy_(0, index, sub.masked_fill_(sub < kth_largest, float("-inf")))


def _apply_top_p(logits: torch.Tensor, rows: list[int], top_ps: list[float]) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches p (and tokens tied with the
    least likely of them)."""
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    probs = sub.softmax(dim=-1)
    ps = torch.tensor(top_ps, dtype=probs.dtype, device=device).unsqueeze(1)
    candidates = min(_TOP_P_CANDIDATES, logits.shape[1])
    threshold = _nucleus_threshold(probs.topk(candidates, dim=-1).values, ps)
    wide = (threshold < 0).squeeze(1).nonzero().squeeze(1)
    if wide.numel():
        everything = probs.index_select(0, wide).sort(dim=-1, descending=True).values
        threshold[wide] = _nucleus_threshold(everything, ps.index_select(0, wide)).clamp_(min=0)
    logits.index_copy_(0, index, sub.masked_fill_(probs < threshold, float("-inf")))


def _nucleus_threshold(descending_probs: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the probability of the token at which the running mass first reaches p, or -1 where the
    given tokens do not reach p."""
    cumulative = descending_probs.cumsum(dim=-1)
    cut = (cumulative < ps).sum(dim=-1, keepdim=True)
    found = cut < descending_probs.shape[1]
    threshold = descending_probs.gather(1, cut.clamp(max=descending_probs.shape[1] - 1))
    return torch.where(found, threshold, torch.full_like(threshold, -1.0))


def _gather_logprobs(
    raw_logprobs: torch.Tensor | None,
    token_ids: torch.Tensor,
    token_list: list[int],
    params: list[SamplingParams],
) -> list[dict[int, float] | None]:
    if raw_logprobs is None:
        return [None] * len(params)
    max_n = max(p.logprobs or 0 for p in params)
    top_values, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    top_values_list = top_values.tolist() if top_values is not None else None
    top_ids_list = top_ids.tolist() if top_ids is not None else None
    result: list[dict[int, float] | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        entry: dict[int, float] = {}
        if p.logprobs and top_ids_list is not None and top_values_list is not None:
            entry = dict(
                zip(top_ids_list[row][: p.logprobs], top_values_list[row][: p.logprobs], strict=True)
            )
        entry[token_list[row]] = sampled[row]
        result.append(entry)
    return result
