"""The body writer's framing, its coalescing of one loop turn's chunks, and where it stands aside."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import h11

from kvpilot.runtime.server.body_writer import body_writer


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def _cycle(http_version: bytes = b"1.1", method: str = "POST"):
    return SimpleNamespace(
        conn=SimpleNamespace(their_http_version=http_version), scope={"method": method},
        flow=SimpleNamespace(write_paused=False), transport=Transport(), disconnected=False,
        response_started=True, response_complete=False,
    )


def _dechunk(data: bytes) -> list[bytes]:
    """The chunks of a chunked body, read back by h11 as a client would."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + data + b"0\r\n\r\n")
    chunks = []
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        if isinstance(event, h11.Data):
            chunks.append(bytes(event.data))
    return chunks


def test_the_chunks_of_one_loop_turn_go_out_in_one_write_framed_as_http_chunks():
    async def scenario():
        cycle = _cycle()
        writer = body_writer(cycle)
        writer.write(b"data: one\n\n")
        writer.write(b"data: two\n\n")
        assert cycle.transport.writes == []  # not before the loop turn ends
        await asyncio.sleep(0)
        writes_after_turn = list(cycle.transport.writes)
        writer.write(b"data: three\n\n")
        writer.flush()  # what the response does before its last message
        return writes_after_turn, cycle.transport.writes

    after_turn, writes = asyncio.run(scenario())
    assert len(after_turn) == 1 and _dechunk(after_turn[0]) == [b"data: one\n\n", b"data: two\n\n"]
    assert len(writes) == 2 and _dechunk(writes[1]) == [b"data: three\n\n"]


def test_chunks_for_a_client_that_left_are_dropped_and_a_chunk_outside_a_response_is_an_error():
    async def scenario():
        cycle = _cycle()
        writer = body_writer(cycle)
        cycle.disconnected = True
        writer.write(b"data: lost\n\n")
        await asyncio.sleep(0)
        assert cycle.transport.writes == [] and not writer.must_wait()
        cycle.disconnected, cycle.response_complete = False, True
        try:
            writer.write(b"data: late\n\n")
        except RuntimeError as err:
            return str(err)

    assert "outside a streamed response" in asyncio.run(scenario())


def test_a_paused_transport_must_be_drained_first():
    async def scenario():
        cycle = _cycle()
        cycle.flow.write_paused = True
        return body_writer(cycle).must_wait()

    assert asyncio.run(scenario())


def test_no_writer_where_h11_would_not_frame_the_body_as_chunks():
    # HTTP/1.0: the body ends with the connection; HEAD: there is no body.
    assert body_writer(_cycle(http_version=b"1.0")) is None
    assert body_writer(_cycle(method="HEAD")) is None
