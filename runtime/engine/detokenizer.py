"""Incremental detokenization and stop strings, for one sequence, in the API-server process."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# How much of the prompt's tail the stream decodes first, so that the first output token is
# decoded as a continuation: a SentencePiece-style decoder drops the leading space of the first
# token it sees (" Paris" would come out "Paris"), and one character's bytes may span several
# byte-fallback tokens.
PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive, and finds stop strings in that text.

    While stop strings are set, the last `len(longest stop) - 1` characters are held back from
    the stream: they could still turn out to be the start of a stop string. Only the text not
    yet taken is kept, and each token's text is searched together with the held-back tail
    before it, so the work per token is bounded by the stop strings' sizes, never by how much
    was generated.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, prompt_token_ids: Sequence[int] = (),
                 resume_token_ids: Sequence[int] = ()) -> None:
        """`resume_token_ids`: output an earlier stream of this sequence decoded and sent (a stream
        resumed elsewhere). The text continues from them, and begins with what that stream still
        held back, so that its text and this one's add up to the uninterrupted text."""
        self._tokenizer = tokenizer
        # DecodeStream keeps the byte-level state, so a multi-byte character split across
        # tokens comes out whole, once.
        self._stream = DecodeStream(skip_special_tokens=True)
        # Stepped through rather than passed as DecodeStream(ids=...), which returns the prompt's
        # text with the first token when the prompt ends inside a character.
        for token_id in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(tokenizer, token_id)
        self._stop = [s for s in stop or [] if s]
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        # The text decoded and not taken yet.
        self._pending = ""
        if resume_token_ids:
            # Taken as the earlier stream took it after these tokens: all but the held-back tail.
            self.update(resume_token_ids)
            self.take_new_text(finished=False)

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that ended the text, if one did."""
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                continue
            if not self._stop:
                self._pending += piece
                continue
            # Whatever lies before the held-back tail was searched already.
            searched_before = max(0, len(self._pending) - self._holdback)
            self._pending += piece
            stop = self._find_stop(searched_before)
            if stop is not None:
                return stop
        return None

    def _find_stop(self, start: int) -> str | None:
        found = [(self._pending.find(s, start), s) for s in self._stop]
        found = [(pos, s) for pos, s in found if pos != -1]
        if not found:
            return None
        pos, stop = min(found)
        self._pending = self._pending[: pos + (len(stop) if self._include_stop else 0)]
        return stop

    def take_new_text(self, finished: bool) -> str:
        """The text not returned yet; short of the held-back tail until the sequence finishes."""
        end = len(self._pending) if finished else max(0, len(self._pending) - self._holdback)
        new, self._pending = self._pending[:end], self._pending[end:]
        return new
