"""Grammar compilation in the engine core, off the step loop, and each request's grammar state.

Compiling a grammar against the vocabulary takes from milliseconds to seconds, so it runs beside the step
loop: a request whose grammar is not ready yet waits in the queue while the others run, the way vLLM's
WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR state does. Compiled grammars are cached by their canonical text (the
compiler belongs to one tokenizer, so that is a key by grammar and tokenizer).

Some grammars take minutes or more (large bounded repetitions, say). A compilation gets a time limit, past
which its requests fail with GrammarTimeoutError. xgrammar cannot interrupt a compilation, so each one runs in
a compile process (compile_worker), which is killed at the limit: at most `_CONCURRENT_COMPILATIONS` compile
at once, and nothing runs on past its limit. The compile processes are forked from a compile server that
imported xgrammar once, so one killed is replaced in milliseconds. The failure stays cached, so asking for the
same grammar again fails at once instead of starting it over.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.errors import (
    EngineError,
    GrammarTimeoutError,
    InvalidContinuationError,
    InvalidRequestError,
)
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.structured_outputs.bitmasks import pack_bits
from kvfleet.runtime.structured_outputs.compile_worker import (
    CompilerExitedError,
    CompileServer,
    CompileTimeoutError,
    CompileWorker,
)
from kvfleet.runtime.structured_outputs.grammars import JSON_KINDS, GrammarError, grammar_key

if TYPE_CHECKING:
    # xgrammar and Transformers take over a second to import: an engine that never constrains never does.
    import xgrammar
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_CACHED_GRAMMARS = 512
# Compilations (and so compile processes) at once; compiling is CPU-bound, and the engine needs a core.
_CONCURRENT_COMPILATIONS = 2
# Bytes JSON never holds raw: compact JSON has no newlines or tabs, and strings escape control characters.
_CONTROL_BYTES = frozenset(range(0x20))
# UTF-8 encodes surrogates (U+D800-DFFF, not characters) as 0xED then 0xA0-0xBF.
_SURROGATE_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


@dataclass(frozen=True)
class CompiledConstraint:
    grammar: xgrammar.CompiledGrammar
    # A bitmask row ANDed into the grammar's own, for what xgrammar lets through: it accepts UTF-8-encoded
    # surrogates, which are not text, and lets length-bounded JSON strings hold raw control characters,
    # which JSON forbids.
    token_filter: torch.Tensor


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary in compile processes, within a time limit, caching the
    results; holds the tokenizer that bad_words are encoded with."""

    def __init__(self, tokenizer_path: str, vocab_size: int, timeout: float) -> None:
        self._tokenizer_path = tokenizer_path
        # Seconds a compilation may take, counted from its start (not from its wait for a free place).
        self._timeout = timeout
        # The model's, not the tokenizer's: logits rows (and so bitmasks) are as wide as the model's
        # embedding, which is often padded past the tokenizer's last id.
        self._vocab_size = vocab_size
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._text_token_filter: torch.Tensor | None = None
        self._json_token_filter: torch.Tensor | None = None
        self._places = threading.Semaphore(_CONCURRENT_COMPILATIONS)
        # Compile processes forked at first need, each used by one compilation at a time, and the server
        # they are forked from (started at the first, and again if it died).
        self._idle_workers: list[CompileWorker] = []
        self._workers: set[CompileWorker] = set()
        self._servers: list[CompileServer] = []
        self._server_lock = threading.Lock()
        self._shut_down = False
        # Killed when the engine shuts down, or when this compiler is collected (an LLM dropped, say).
        self._kill_workers = weakref.finalize(self, _kill_all, self._workers, self._servers)
        # The vocabulary is prepared once, by the first compilation.
        self._vocabulary_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledConstraint]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        # Cache hits are not compilations.
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledConstraint]:
        """The compiled grammar, soon. Raises GrammarError at once for a constraint that is not JSON."""
        key = grammar_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future: Future[CompiledConstraint] = Future()
            threading.Thread(
                target=self._run, args=(*key, future), name="grammar-compiler", daemon=True
            ).start()
            self._cache[key] = future
            if len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        """Stops the compile processes; compilations in progress fail."""
        with self._lock:
            self._shut_down = True
        self._kill_workers()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        # Loaded at first use, so that servers that never constrain pay nothing.
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, kind: str, text: str, future: Future[CompiledConstraint]) -> None:
        with self._places:
            try:
                compiled = self._compile(kind, text)
            except Exception as exc:  # anything: the requests waiting for it fail, the engine goes on
                future.set_exception(exc)
            else:
                future.set_result(compiled)

    def _compile(self, kind: str, text: str) -> CompiledConstraint:
        # The vocabulary and the compile server (once per engine) and a compile process: not the grammar's
        # doing, so outside its time limit.
        tokenizer_info = self._vocabulary()
        worker = self._idle_worker(tokenizer_info)
        start = time.perf_counter()
        try:
            serialized = worker.compile(kind, text, self._timeout)
        except CompileTimeoutError:
            logger.warning("a %s grammar ran out of its %g s to compile", kind, self._timeout)
            raise GrammarTimeoutError(
                f"the {kind} grammar took longer than {self._timeout:g} s to compile; simplify it"
            ) from None
        finally:
            self._give_back(worker)
        import xgrammar

        grammar = xgrammar.CompiledGrammar.deserialize_json(serialized, tokenizer_info)
        token_filter = self._json_token_filter if kind in JSON_KINDS else self._text_token_filter
        assert token_filter is not None
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += elapsed
        logger.debug("compiled a %s grammar in %.3f s", kind, elapsed)
        return CompiledConstraint(grammar, token_filter)

    def _idle_worker(self, tokenizer_info: xgrammar.TokenizerInfo) -> CompileWorker:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("the engine is shutting down")
            while self._idle_workers:
                worker = self._idle_workers.pop()
                if worker.alive:
                    return worker
                self._workers.discard(worker)  # killed while idle (the OOM killer, say)
        try:
            worker = self._server(tokenizer_info).fork()
        except CompilerExitedError:  # the server died since the last fork (the OOM killer, say): a new one
            worker = self._server(tokenizer_info).fork()
        with self._lock:
            self._workers.add(worker)
            if self._shut_down:
                worker.kill()
        return worker

    def _server(self, tokenizer_info: xgrammar.TokenizerInfo) -> CompileServer:
        """The compile server, started at first need or when the last one has died."""
        with self._server_lock:
            if not self._servers or not self._servers[-1].alive:
                for dead in self._servers:
                    dead.kill()
                self._servers[:] = [CompileServer(tokenizer_info.serialize_json())]
            server = self._servers[-1]
        with self._lock:
            if self._shut_down:
                server.kill()
        return server

    def _give_back(self, worker: CompileWorker) -> None:
        """Back among the idle ones, or forgotten if it has been stopped (a timeout, a crash, shutdown)."""
        with self._lock:
            if worker.alive:
                self._idle_workers.append(worker)
            else:
                self._workers.discard(worker)

    def _vocabulary(self) -> xgrammar.TokenizerInfo:
        with self._vocabulary_lock:
            if self._tokenizer_info is None:
                self._tokenizer_info = self._prepare_vocabulary()
            return self._tokenizer_info

    def _prepare_vocabulary(self) -> xgrammar.TokenizerInfo:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self._vocab_size)
        text = torch.ones(self._vocab_size, dtype=torch.bool)
        json_text = torch.ones(self._vocab_size, dtype=torch.bool)
        for token_id, token in enumerate(info.decoded_vocab[: self._vocab_size]):
            if _may_start_a_surrogate(token):
                text[token_id] = json_text[token_id] = False
            elif _CONTROL_BYTES.intersection(token):
                json_text[token_id] = False
        self._text_token_filter = pack_bits(text)
        self._json_token_filter = pack_bits(json_text)
        return info


class RequestGrammar:
    """One request's constraint: its compiled grammar once ready, and a matcher that follows its output."""

    def __init__(
        self,
        compiled: Future[CompiledConstraint],
        *,
        end_token_ids: Sequence[int] = (),
        resumed: bool = False,
    ) -> None:
        """`end_token_ids`: those that may end the output once the grammar is complete, the request's
        end-of-sequence and stop tokens, as in vLLM (by default xgrammar's, the tokenizer's end-of-sequence
        token alone). `resumed`: the request arrives with output (a continuation), which the matcher must
        accept (catch_up) before the request is sampled."""
        self.compiled = compiled
        self._end_token_ids = end_token_ids
        self._matcher: xgrammar.GrammarMatcher | None = None
        self._caught_up = not resumed

    @property
    def compiled_ok(self) -> bool:
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def ready(self) -> bool:
        """Compiled successfully and caught up with the output the request arrived with; `error` tells a
        failure apart from a compilation still running."""
        return self._caught_up and self.compiled_ok

    def catch_up(self, token_ids: list[int]) -> None:
        """Once compiled: advance past the output a continuation brought. Raises InvalidContinuationError at
        a token the grammar does not allow, or when the grammar is complete (the request would have
        stopped there)."""
        matcher = self.matcher
        for position, token_id in enumerate(token_ids, start=1):
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                raise InvalidContinuationError(
                    f"resumed token {position} of {len(token_ids)} ({token_id}) does not follow the "
                    "request's grammar"
                )
        if matcher.is_terminated():
            raise InvalidContinuationError(
                "the request's grammar is complete after its resumed tokens: a finished choice is resumed "
                "with finished true"
            )
        self._caught_up = True

    @property
    def error(self) -> EngineError | None:
        """Why the grammar could not be compiled, once it is known."""
        if not self.compiled.done():
            return None
        exc = self.compiled.exception()
        if exc is None or isinstance(exc, GrammarTimeoutError):
            return exc
        return InvalidRequestError(
            str(exc) if isinstance(exc, GrammarError) else f"the grammar failed to compile: {exc}"
        )

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(
                self.compiled.result().grammar, override_stop_tokens=list(self._end_token_ids) or None
            )
        return self._matcher

    @property
    def token_filter(self) -> torch.Tensor:
        return self.compiled.result().token_filter

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def allowed_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of token_ids (draft tokens) that the grammar allows from its current state, up
        to where it terminates; the matcher is rolled back to where it was."""
        matcher = self.matcher
        accepted = 0
        for token_id in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return token_ids[:accepted]


def _may_start_a_surrogate(token: bytes) -> bool:
    """Whether the token holds a surrogate's first bytes, or ends where one could begin."""
    for index, byte in enumerate(token):
        if byte == _SURROGATE_LEAD and (index + 1 == len(token) or token[index + 1] in _SURROGATE_SECOND):
            return True
    return False


def _kill_all(workers: set[CompileWorker], servers: list[CompileServer]) -> None:
    for worker in list(workers):
        worker.kill()
    for server in list(servers):
        server.kill()
