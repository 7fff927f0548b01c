"""Turns one step's logits into tokens, for a batch of requests with their own sampling parameters.

Order (vLLM's): the tokens structured outputs' grammars forbid are masked; the raw logprobs (of the logits as
the model gave them, within the grammar); allowed_token_ids, bad_words and logit_bias; min_tokens masking of
eos and stop ids; repetition, frequency and presence penalties; a spent thinking_token_budget's forced token
(kvfleet.runtime.worker.thinking_budget); greedy rows (temperature below
GREEDY_TEMPERATURE) take the argmax; other rows are divided by their temperature, then filtered by min_p,
top_k and top_p, and sampled by inverting their cumulative distribution at one uniform draw per row (cheaper
on a CPU than noise over the whole vocabulary); the processed logprobs (of the logits as they were sampled
from). A request with a seed draws from its own generator, so its tokens do not depend on what else is in the
batch.

Speculative decoding verifies draft tokens against the target's distribution at each drafted position,
processed as above with the drafts before it counted as output. Greedy rows accept the longest prefix of the
drafts that matches the argmax. Sampled rows use rejection sampling (Leviathan et al., Chen et al.): the
proposers' drafts are deterministic given the context, so draft token d is accepted with probability p(d),
and at the first rejection the token comes from p with d removed, renormalised; after all drafts, one more
token comes from p. Each emitted token is thus distributed exactly as the target's own sample would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from kvfleet.runtime.config import LogprobsMode
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_outputs.masks import GrammarMasks
from kvfleet.runtime.structured_outputs.token_rules import apply_token_rules
from kvfleet.runtime.worker.thinking_budget import ThinkingBudgets

# Top-p looks for its cut among this many most likely tokens first, and sorts a row only when it is wider.
_TOP_P_CANDIDATES = 256


class DraftPosition:
    """A speculating request as the target sees it at a drafted position: its output followed by the draft
    tokens before that position. Its grammar's mask, which depends on those tokens, is applied apart (see
    GrammarMasks.apply_after_drafts); `grammar` is None here so that the batch's own masking skips it."""

    __slots__ = (
        "eos_token_id",
        "grammar",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "token_rules",
    )

    def __init__(self, request: Request, drafted: list[int]) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.eos_token_id = request.eos_token_id
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + drafted
        self.token_rules = request.token_rules
        self.grammar = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class SpeculativeBatch:
    """The sampled requests of a step in which some verify draft tokens: one row per verified position,
    drafts + 1 rows for each request, in order."""

    requests: list[Request]
    draft_token_ids: list[list[int]]
    rows: list[Request | DraftPosition]

    @classmethod
    def of(cls, requests: list[Request], draft_token_ids: list[list[int]]) -> SpeculativeBatch:
        rows: list[Request | DraftPosition] = []
        for request, drafts in zip(requests, draft_token_ids, strict=True):
            rows.append(request)
            rows.extend(DraftPosition(request, drafts[:position]) for position in range(1, len(drafts) + 1))
        return cls(requests, draft_token_ids, rows)

    def constrained_drafts(self) -> list[tuple[int, Request, list[int]]]:
        """(first row, request, drafts) of the requests with a grammar and drafts."""
        constrained = []
        row = 0
        for request, drafts in zip(self.requests, self.draft_token_ids, strict=True):
            if drafts and request.grammar is not None:
                constrained.append((row, request, drafts))
            row += len(drafts) + 1
        return constrained


@dataclass
class VerifiedTokens:
    # Per request: its accepted draft tokens and one token of the target's.
    token_ids: list[list[int]]
    # Per request: one dict per token (as SamplerOutput's), or None when the request did not ask.
    logprobs: list[list[dict[int, float]] | None]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: the top-N logprobs (as the logprobs mode defines them) plus the sampled token's, or None when
    # the request did not ask.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        thinking_budgets: ThinkingBudgets | None = None,
    ) -> None:
        """`thinking_budgets`: the reasoning's tokens, where the engine has a reasoning config."""
        self.device = device
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.grammar_masks = GrammarMasks(fill_during_forward=device.type != "cpu")
        self.thinking_budgets = thinking_budgets

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests. Preempted requests keep theirs: when one resumes, its
        random stream continues where it stopped, so its tokens are those of an uninterrupted run."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
        if self.thinking_budgets is not None:
            self.thinking_budgets.forget(request_ids)

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
        self.grammar_masks.apply(logits, requests)
        scores = self._scores(logits, params, processed=False)
        apply_token_rules(logits, requests)
        self._mask_stop_tokens_before_min_tokens(logits, requests)
        self._apply_penalties(logits, requests)
        self._force_thinking_ends(logits, requests)
        greedy = [p.greedy for p in params]
        token_ids = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, requests, greedy)
        if scores is None:
            scores = self._scores(logits, params, processed=True)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, _gather_logprobs(scores, token_ids, token_list, params))

    def verify(self, logits: torch.Tensor, batch: SpeculativeBatch) -> VerifiedTokens:
        """logits: float32 [len(batch.rows), vocab], modified in place."""
        rows = batch.rows
        if all(_plain_greedy(r) for r in rows):
            targets = logits.argmax(dim=-1).tolist()
            return VerifiedTokens(
                _accept_greedy(batch.draft_token_ids, targets), [None] * len(batch.requests)
            )
        params = [r.sampling_params for r in rows]
        self.grammar_masks.apply(logits, rows)
        self.grammar_masks.apply_after_drafts(logits, batch.constrained_drafts())
        scores = self._scores(logits, params, processed=False)
        apply_token_rules(logits, rows)
        self._mask_stop_tokens_before_min_tokens(logits, rows)
        self._apply_penalties(logits, rows)
        self._force_thinking_ends(logits, rows)
        greedy = [p.greedy for p in params]
        targets = logits.argmax(dim=-1).tolist() if any(greedy) else []
        probs = None
        if not all(greedy):
            _apply_temperature_and_filters(logits, params, greedy)
            probs = torch.softmax(logits, dim=-1)
        if scores is None:
            scores = self._scores(logits, params, processed=True)
        token_ids = self._accept_sampled(probs, batch, greedy, targets)
        if scores is None:
            return VerifiedTokens(token_ids, [None] * len(batch.requests))
        # The rows of the emitted tokens: each request's first rows, one per token.
        emitted_rows: list[int] = []
        start = 0
        for tokens, drafts in zip(token_ids, batch.draft_token_ids, strict=True):
            emitted_rows.extend(range(start, start + len(tokens)))
            start += len(drafts) + 1
        flat_tokens = [token for tokens in token_ids for token in tokens]
        device = logits.device
        flat_logprobs = _gather_logprobs(
            scores.index_select(0, torch.tensor(emitted_rows, device=device)),
            torch.tensor(flat_tokens, device=device),
            flat_tokens,
            [params[row] for row in emitted_rows],
        )
        logprobs: list[list[dict[int, float]] | None] = []
        start = 0
        for request, tokens in zip(batch.requests, token_ids, strict=True):
            entries = flat_logprobs[start : start + len(tokens)]
            start += len(tokens)
            logprobs.append(None if request.sampling_params.logprobs is None else entries)  # type: ignore[misc]
        return VerifiedTokens(token_ids, logprobs)

    def _accept_sampled(
        self,
        probs: torch.Tensor | None,
        batch: SpeculativeBatch,
        greedy: list[bool],
        targets: list[int],
    ) -> list[list[int]]:
        """Each request's accepted drafts and its own last token; greedy rows by argmax (targets), the
        others by rejection sampling on probs (the processed target distribution of each row)."""
        draft_rows: list[int] = []
        draft_columns: list[int] = []
        start = 0
        for drafts in batch.draft_token_ids:
            if not greedy[start]:
                draft_rows.extend(range(start, start + len(drafts)))
                draft_columns.extend(drafts)
            start += len(drafts) + 1
        draft_probs: dict[int, float] = {}
        if draft_rows:
            assert probs is not None
            index = (
                torch.tensor(draft_rows, device=probs.device),
                torch.tensor(draft_columns, device=probs.device),
            )
            draft_probs = dict(zip(draft_rows, probs[index].tolist(), strict=True))
        token_ids: list[list[int]] = []
        # The requests whose last token is drawn from the target, the row it is drawn from, the draft token
        # it excludes (-1: none), and the uniform draw for it.
        drawing: list[int] = []
        final_rows: list[int] = []
        excluded: list[int] = []
        final_uniforms: list[float] = []
        start = 0
        for request, drafts in zip(batch.requests, batch.draft_token_ids, strict=True):
            if greedy[start]:  # one request's rows share its parameters
                token_ids.append(_accept_greedy([drafts], targets[start : start + len(drafts) + 1])[0])
            else:
                uniforms = self._uniforms(request, len(drafts) + 1)
                accepted = 0
                while accepted < len(drafts) and uniforms[accepted] < draft_probs[start + accepted]:
                    accepted += 1
                drawing.append(len(token_ids))
                final_rows.append(start + accepted)
                excluded.append(drafts[accepted] if accepted < len(drafts) else -1)
                final_uniforms.append(uniforms[-1])
                token_ids.append(drafts[:accepted])
            start += len(drafts) + 1
        if final_rows:
            assert probs is not None
            device = probs.device
            weights = probs.index_select(0, torch.tensor(final_rows, device=device))
            rejected = [i for i, token in enumerate(excluded) if token >= 0]
            if rejected:
                index = (
                    torch.tensor(rejected, device=device),
                    torch.tensor([excluded[i] for i in rejected], device=device),
                )
                draft_weights = weights[index]
                weights[index] = 0.0
                # A draft the target gives all its mass to was rejected only by rounding (p(d) just under
                # 1): the residual is empty, and the draft is what p - q's limit leaves.
                weights[index] = torch.where(weights[index[0]].sum(dim=-1) > 0, 0.0, draft_weights)
            uniform = torch.tensor(final_uniforms, dtype=weights.dtype, device=device).unsqueeze(1)
            for index, token in zip(drawing, _invert_cdf(weights, uniform).tolist(), strict=True):
                token_ids[index].append(token)
        return token_ids

    def _uniforms(self, request: Request, count: int) -> list[float]:
        """count uniform draws for the request: from its own generator when it has a seed."""
        generator = (
            self._request_generator(request) if request.sampling_params.seed is not None else self.generator
        )
        return torch.rand(count, generator=generator, device=self.device).tolist()

    def _scores(
        self, logits: torch.Tensor, params: list[SamplingParams], processed: bool
    ) -> torch.Tensor | None:
        """What the rows' logprobs are drawn from, as the logprobs mode defines them, from the logits as they
        stand (processed: after the sampling settings); None where no row asked for logprobs, or where the
        mode takes them at the other stage."""
        if processed != self.logprobs_mode.startswith("processed") or all(p.logprobs is None for p in params):
            return None
        if self.logprobs_mode.endswith("logits"):
            return logits.clone()
        return torch.log_softmax(logits, dim=-1)

    def _force_thinking_ends(self, logits: torch.Tensor, rows: Sequence[Request | DraftPosition]) -> None:
        if self.thinking_budgets is None:  # the engine has no reasoning config: no request has a budget
            return
        budgets = [row.sampling_params.thinking_token_budget for row in rows]
        if any(budget is not None for budget in budgets):
            self.thinking_budgets.force(logits, rows, budgets)

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
        _apply_temperature_and_filters(logits, params, greedy)
        uniform = torch.rand(len(requests), 1, generator=self.generator, device=device)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None and not greedy[row]:
                uniform[row] = torch.rand(1, generator=self._request_generator(request), device=device)
        sampled = _invert_cdf(torch.softmax(logits, dim=-1), uniform)
        if greedy_tokens is not None:
            sampled = torch.where(torch.tensor(greedy, device=device), greedy_tokens, sampled)
        return sampled

    def _request_generator(self, request: Request) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_params.seed
            assert seed is not None
            generator = torch.Generator(device=self.device).manual_seed(seed)
            # A request first sampled with output already (a continuation) skips the draws that output took,
            # one per token, each as it was drawn (a draw of several numbers at once may take the stream
            # differently), so that its stream goes on where it stopped.
            for _ in range(request.num_output_tokens):
                torch.rand(1, generator=generator, device=self.device)
            self._request_generators[request.request_id] = generator
        return generator


def _apply_temperature_and_filters(
    logits: torch.Tensor, params: list[SamplingParams], greedy: list[bool]
) -> None:
    """Divide the sampled rows by their temperature, then apply their min_p, top_k and top_p."""
    temperatures = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    if any(t != 1.0 for t in temperatures):
        logits.div_(torch.tensor(temperatures, dtype=logits.dtype, device=logits.device).unsqueeze(1))
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


def _invert_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows]: per row, the first token whose cumulative weight exceeds uniform [rows, 1] times the row's
    total (weights need not be normalised); zero-weight tokens are never drawn."""
    cumulative = weights.cumsum(dim=-1)
    sampled = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
    return sampled.clamp_(max=weights.shape[1] - 1).squeeze(1)


def _accept_greedy(draft_token_ids: list[list[int]], targets: list[int]) -> list[list[int]]:
    """Per request, the drafts that match the target's argmax up to the first mismatch, and the target's
    token there. targets: one per verified row, drafts + 1 per request, in order."""
    token_ids = []
    start = 0
    for drafts in draft_token_ids:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[start + accepted]:
            accepted += 1
        token_ids.append([*drafts[:accepted], targets[start + accepted]])
        start += len(drafts) + 1
    return token_ids


def _plain_greedy(request: Request | DraftPosition) -> bool:
    """Greedy with nothing to apply first: no logprobs, penalties, grammar, token rules or thinking budget,
    and min_tokens already reached."""
    params = request.sampling_params
    return (
        params.greedy
        and request.grammar is None
        and request.token_rules is None
        and params.logprobs is None
        and params.thinking_token_budget is None
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
    scores: torch.Tensor | None,
    token_ids: torch.Tensor,
    token_list: list[int],
    params: list[SamplingParams],
) -> list[dict[int, float] | None]:
    if scores is None:
        return [None] * len(params)
    max_n = max(p.logprobs or 0 for p in params)
    top_values, top_ids = scores.topk(max_n, dim=-1) if max_n else (None, None)
    sampled = scores.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
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
