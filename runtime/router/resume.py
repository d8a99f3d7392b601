"""A stream followed event by event, so that another replica can go on where a dead one stopped.

The router asks the engine for the token ids of what it streams (vLLM's `return_token_ids`) and
keeps them. When the replica dies mid-stream, the same request goes to another replica with those
tokens as `resume_token_ids`: the engine takes them as output already generated, samples on from
them (a seeded request's random stream advanced past them) and streams only what follows. The
client sees one stream: the resumed one's opening chunks are dropped, and its `id` and `created`
are the first one's.

Only a stream whose continuation is a function of its tokens so far resumes: greedy or seeded,
one choice of one prompt, no tools, no grammar, no echo. Any other ends with an error event.
"""

from __future__ import annotations

import msgspec

from kvpilot.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

DATA = b"data: "
DONE = b"[DONE]"
# What ends a server-sent event.
SEPARATOR = b"\n\n"
# How every chunk of the engine's stream begins, and how its serializer writes a choice's token ids.
CHUNK_START = DATA + b'{"id":'
TOKEN_IDS_KEY = b',"token_ids":['
# The error code of the engine's own error event when its EngineCore dies (serving.engine_dead_error).
ENGINE_DEAD = "engine_dead"


class ReplicaLost(Exception):
    """The replica's stream broke off before its end."""


def why_not_resumable(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """Why this streamed request could not continue on another replica with identical tokens; None if it can."""
    if body.n != 1:
        return "it has n > 1"
    if isinstance(body, CompletionRequest):
        if len(body.prompts) != 1:
            return "it is a batch of prompts"
        if body.echo:
            return "it echoes its prompt"
    elif body.tools:
        return "it offers tools"
    try:
        constrained = body.structured_outputs_params()[0] is not None
    except ValueError:
        return "its structured outputs are invalid"
    if constrained:
        return "its output follows a grammar"
    if body.seed is None and body.temperature != 0:
        return "it samples without a seed"
    return None


class StreamSplice:
    """The events of one resumable stream, as the client gets them, and the token ids sent so far."""

    def __init__(self, client_wants_token_ids: bool) -> None:
        self.client_wants_token_ids = client_wants_token_ids
        self.token_ids: list[int] = []
        self.done = False
        self._first: dict | None = None
        # True from a resume until the new stream's first token: its opening chunks were sent already.
        self._opening = False
        self._resumed_once = False
        # The start of an event whose end has not arrived yet.
        self._partial = b""

    def resumed(self) -> None:
        self._opening = self._resumed_once = True
        self._partial = b""

    def feed(self, data: bytes) -> bytes:
        """What to send the client for the events `data` completes (b"": nothing yet), in one piece:
        a write per event would cost the server more. ReplicaLost when an event says the engine died."""
        *events, self._partial = (self._partial + data).split(SEPARATOR)
        relayed = [event for event in map(self._relay, events) if event is not None]
        return SEPARATOR.join(relayed) + SEPARATOR if relayed else b""

    def end(self) -> None:
        """The replica's stream ended: ReplicaLost unless it ended with [DONE]."""
        if self._partial.strip():
            raise ReplicaLost("the stream broke off inside an event")
        if not self.done:
            raise ReplicaLost("the stream ended before [DONE]")

    def _relay(self, event: bytes) -> bytes | None:
        """One event (without its blank line) as the client gets it; None: not sent."""
        if self._first is not None and not self._resumed_once and event.startswith(CHUNK_START):
            relayed = self._relay_undecoded(event)
            if relayed is not None:
                return relayed
        return self._relay_decoded(event)

    def _relay_undecoded(self, event: bytes) -> bytes | None:
        """A chunk of an unbroken stream, past its first, read without decoding it: its token ids
        are the one list under TOKEN_IDS_KEY. None for a chunk not written that way (decode it then).

        Decoding and encoding each chunk costs 1.5 times as much (about 0.7 µs more a token, on the
        machine of BENCHMARKS.md). The key cannot be matched inside a string value: there every
        quote is escaped.
        """
        keys = event.count(b'token_ids"')
        if keys == 0:
            return event
        start = event.find(TOKEN_IDS_KEY)
        end = event.find(b"]", start)
        if keys > 1 or start < 0 or end < 0:
            return None
        listed = event[start + len(TOKEN_IDS_KEY):end]
        try:
            token_ids = [int(token_id) for token_id in listed.split(b",")] if listed.strip() else []
        except ValueError:
            return None
        self.token_ids += token_ids
        return event if self.client_wants_token_ids else event[:start] + event[end + 1:]

    def _relay_decoded(self, event: bytes) -> bytes | None:
        payload = event[len(DATA):].strip() if event.startswith(DATA) else None
        if payload is None:
            return event
        if payload == DONE:
            self.done = True
            return event
        try:
            chunk = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            raise ReplicaLost(f"the replica sent an event that is not JSON: {payload[:80]!r}") from None
        error = chunk.get("error")
        if error is not None:
            if isinstance(error, dict) and error.get("code") == ENGINE_DEAD:
                raise ReplicaLost(error.get("message", ENGINE_DEAD))
            return event
        choices = chunk.get("choices") or []
        for choice in choices:
            self.token_ids += choice.get("token_ids") or ()
        if self._first is None:
            self._first = {"id": chunk.get("id"), "created": chunk.get("created")}
        elif self._opening:
            if not (chunk.get("usage") or any(c.get("token_ids") or c.get("finish_reason") for c in choices)):
                return None
            self._opening = False
        return DATA + msgspec.json.encode(chunk) if self._rewrite(chunk, choices) else event

    def _rewrite(self, chunk: dict, choices: list[dict]) -> bool:
        changed = False
        if chunk.get("id") != self._first["id"] or chunk.get("created") != self._first["created"]:
            chunk.update(self._first)
            changed = True
        if not self.client_wants_token_ids:
            changed |= chunk.pop("prompt_token_ids", None) is not None
            for choice in choices:
                changed |= choice.pop("token_ids", None) is not None
                changed |= choice.pop("prompt_token_ids", None) is not None
        return changed
