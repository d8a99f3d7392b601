"""Which streams can resume, and how a resumed stream is spliced onto the first one."""

import json

import pytest

from kvpilot.runtime.router.resume import ReplicaLost, StreamSplice, why_not_resumable
from kvpilot.runtime.server.protocol import ChatCompletionRequest, CompletionRequest


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", "stream": True, **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields})


@pytest.mark.parametrize("body, reason", [
    (completion(temperature=0), None),
    (completion(seed=3), None),
    (chat(temperature=0.7, seed=3), None),
    (completion(), "samples without a seed"),
    (completion(temperature=0, n=2), "n > 1"),
    (completion(temperature=0, prompt=["a", "b"]), "batch of prompts"),
    (completion(temperature=0, echo=True), "echoes its prompt"),
    (chat(temperature=0, tools=[{"type": "function", "function": {"name": "f"}}]), "offers tools"),
    (chat(temperature=0, response_format={"type": "json_object"}), "follows a grammar"),
])
def test_only_a_stream_that_is_a_function_of_its_tokens_resumes(body, reason):
    found = why_not_resumable(body)
    assert (found is None) if reason is None else (reason in found)


def event(**chunk) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def choice(text="", token_ids=None, finish_reason=None, role=None):
    delta = {"content": text} if role is None else {"role": role, "content": ""}
    return {"index": 0, "delta": delta, "finish_reason": finish_reason,
            **({} if token_ids is None else {"token_ids": token_ids})}


def decoded(relayed: bytes) -> dict:
    return json.loads(relayed[len(b"data: "):])


def test_a_resumed_stream_continues_the_first_under_its_id():
    splice = StreamSplice(client_wants_token_ids=False)
    opening = event(id="a", created=1, choices=[choice(role="assistant")])
    assert splice.feed(opening) == opening  # nothing to change: passed on as it came
    assert decoded(splice.feed(event(id="a", created=1, choices=[choice("x", [5])]))) == \
        {"id": "a", "created": 1, "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    splice.resumed()
    # The second replica's own opening is not sent again.
    assert splice.feed(event(id="b", created=2, choices=[choice(role="assistant")])) == b""
    resumed = decoded(splice.feed(event(id="b", created=2, choices=[choice("y", [6], "length")])))
    assert (resumed["id"], resumed["created"], resumed["choices"][0]["delta"]) == ("a", 1, {"content": "y"})
    assert splice.token_ids == [5, 6]
    assert not splice.done
    assert splice.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert splice.done


def test_token_ids_stay_when_the_client_asked_for_them():
    splice = StreamSplice(client_wants_token_ids=True)
    original = event(id="a", created=1, choices=[choice("x", [5])])
    assert splice.feed(original) == original


def test_the_engines_dead_event_and_garbage_are_a_lost_replica_other_errors_pass():
    splice = StreamSplice(client_wants_token_ids=False)
    with pytest.raises(ReplicaLost, match="not running"):
        splice.feed(event(error={"message": "the engine is not running", "code": "engine_dead"}))
    with pytest.raises(ReplicaLost, match="not JSON"):
        splice.feed(b"data: <html>\n\n")
    too_slow = event(error={"message": "too slow", "code": "client_too_slow"})
    assert splice.feed(too_slow) == too_slow


def test_events_split_across_reads_are_relayed_whole_and_together():
    splice = StreamSplice(client_wants_token_ids=True)
    first, second = event(id="a", created=1, choices=[choice("x", [5])]), event(id="a", created=1, choices=[choice("y", [6])])
    assert splice.feed(first[:10]) == b""
    assert splice.feed(first[10:] + second[:-1]) == first
    assert splice.feed(second[-1:] + b"data: [DONE]\n\n") == second + b"data: [DONE]\n\n"
    assert splice.token_ids == [5, 6]
    splice.end()


@pytest.mark.parametrize("tail, reason", [(b"", "before \\[DONE\\]"), (b"data: {\"id\"", "inside an event")])
def test_a_stream_that_ends_early_is_a_lost_replica(tail, reason):
    splice = StreamSplice(client_wants_token_ids=True)
    splice.feed(event(id="a", created=1, choices=[choice("x", [5])]) + tail)
    with pytest.raises(ReplicaLost, match=reason):
        splice.end()



TRICKY_TEXTS = ["", "plain", 'a "quoted" word', "back\\slash\\", ',"token_ids":[1,2]', 'token_ids"', "]", "ünï ☃ \n"]


def compact_event(**chunk) -> bytes:
    """An event as the engine's serializer writes it: no spaces, non-ASCII as it is."""
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("token_ids", [[7], [1, 22, 333], []])
@pytest.mark.parametrize("wants_ids", [False, True])
def test_a_chunk_read_undecoded_is_relayed_as_decoding_it_would(text, token_ids, wants_ids):
    chunks = [compact_event(id="a", created=1, choices=[choice(text, token_ids)]),
              compact_event(id="a", created=1, choices=[choice(text, token_ids, "stop")], usage=None),
              compact_event(id="a", created=1, choices=[], usage={"completion_tokens": 3})]
    fast, reference = StreamSplice(wants_ids), StreamSplice(wants_ids)
    reference._relay = reference._relay_decoded  # every chunk decoded
    decodes = []
    fast._relay_decoded = lambda event, decode=fast._relay_decoded: decodes.append(event) or decode(event)
    for splice in (fast, reference):
        splice.feed(compact_event(id="a", created=1, choices=[choice("x", [5])]))
    for chunk in chunks:
        assert decoded(fast.feed(chunk)) == decoded(reference.feed(chunk))
    assert fast.token_ids == reference.token_ids == [5, *token_ids, *token_ids]
    # The first chunk alone: a text that spells the key out has its quotes escaped, never matched.
    assert len(decodes) == 1
