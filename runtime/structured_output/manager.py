"""The engine core's side of structured outputs: grammars compiled off the step loop, one matcher
per request advanced on its accepted tokens, and the token bitmask of each step.

The bitmask is computed here, once, in the engine core, and shipped to every TP rank inside the
SchedulerOutput (as vLLM does): a matcher's state is a function of the tokens the engine core has
accepted, which the ranks do not all see, so a per-rank mask could only agree by replaying the
same work on every rank.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import llguidance.numpy
import numpy as np

from kvpilot.runtime.core.sched.output import GrammarBitmask
from kvpilot.runtime.structured_output.grammar import check
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse, by constraint; each is a matcher in its start state.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputRequest:
    """One request's grammar: ready once compiled; then its matcher follows the output tokens."""

    def __init__(self, compiled: Future) -> None:
        # The grammar in its start state (an LLMatcher), shared by every request with the same constraint.
        self.compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        # Tokens the matcher has consumed: equal to the request's output tokens between steps.
        self.num_accepted = 0

    @property
    def is_ready(self) -> bool:
        """Compiled (successfully or not): the scheduler may admit the request."""
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return str(self.compiled.exception())

    def start(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            self.matcher = self.compiled.result().deep_copy()
        return self.matcher

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (the mask allowed it, so the matcher takes it)."""
        matcher = self.start()
        if not matcher.consume_token(token_id):
            # Only a bug gets here (a mask the sampler did not apply): the matcher is in its error
            # state for good, which ends the request (is_finished) rather than the engine.
            logger.error("grammar refused sampled token %d: %s", token_id, matcher.get_error())
        self.num_accepted += 1

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: it admits no further token (an EOS it allowed was sampled, or
        nothing can extend it), or it is broken."""
        return self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error())

    def sync(self, output_token_ids: list[int]) -> llguidance.LLMatcher:
        """The matcher, rebuilt from the request's output tokens if it drifted from them (tokens it
        accepted that the request then dropped): the mask must follow the tokens the request has."""
        matcher = self.start()
        if self.num_accepted != len(output_token_ids):
            matcher.reset()
            if output_token_ids and not matcher.consume_tokens(output_token_ids):
                logger.error("grammar refuses the request's own output: %s", matcher.get_error())
            self.num_accepted = len(output_token_ids)
        return matcher


class StructuredOutputManager:
    """Compiles on a background thread (llguidance drops the GIL), caches by constraint, fills masks.

    `tokenizer_json` is called once, on that thread, the first time a grammar is compiled, so an
    engine that never sees a grammar never loads one.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._num_words = -(-vocab_size // 32)

    def request_for(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        key = params.key
        compiled = self._cache.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._compiler.submit(self._compile, params)
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return StructuredOutputRequest(compiled)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None)
        matcher = llguidance.LLMatcher(self._tokenizer, check(params), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    @staticmethod
    def wait_for_any(pending: Iterable[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of `pending` is compiled, or `timeout` seconds: an engine with nothing but
        grammars to wait for sleeps instead of spinning."""
        wait([p.compiled for p in pending], timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, sampling: list[tuple[str, StructuredOutputRequest, list[int]]]) -> GrammarBitmask | None:
        """The next-token mask of each (request id, grammar, output tokens) about to sample; None when
        no request in the step has a grammar, so that such a step pays nothing."""
        if not sampling:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=min(8, os.cpu_count() or 1))
        bitmask = np.empty((len(sampling), self._num_words), dtype=np.int32)
        matchers = [(grammar.sync(output), row) for row, (_, grammar, output) in enumerate(sampling)]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        return GrammarBitmask(req_ids=[req_id for req_id, _, _ in sampling], bitmask=bitmask.tobytes())

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
