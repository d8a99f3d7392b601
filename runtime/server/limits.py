"""The server's bounds on what one request, one tenant and one connection may cost.

Each field is a `kvpilot serve` flag (cli.py's HTTP group); README's "Limits and hardening"
section lists them with the reasons for their defaults. They are server settings, not engine
settings: the engine never sees a request that broke one.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    # 413 above this, before the body is parsed. A prompt filling a 128k-token context is about
    # 1 MiB of JSON as token ids or as text; 4 MiB leaves room for chat overhead and escapes.
    max_request_body_bytes: int = 4 * MIB
    # Choices per request (sequences in the engine).
    max_n: int = 128
    # Stop strings per request and characters per stop string: the matcher's work per token is
    # at most count * (length + the token's text), whatever the generated length.
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 1024
    # A stream whose client has not taken a chunk for this long is aborted (its KV freed).
    stream_stall_timeout_s: float = 30.0
    # Deltas buffered per request for a client that is not reading; past it the request is aborted.
    max_buffered_outputs: int = 4096
    # The kernel's send buffer per connection (Linux lets it grow to 4 MiB for a client that does
    # not read). 256 KiB is a thousand token events, and more than a 100 ms, 10 Mbit/s link holds.
    socket_send_buffer_bytes: int = 256 * 1024
    # Threads that tokenize, render chat templates and detokenize, off the event loop.
    tokenizer_pool_size: int = 2
    # uvicorn: idle time allowed between the requests of a keep-alive connection. It must outlast
    # the idle time after which clients stop reusing a pooled connection: a server that closes
    # first resets a request sent on the connection just before its close arrives, and the client
    # sees a ReadError for a request never served. uvicorn's 5 s equals httpx's (so the openai
    # SDK's) expiry and loses that race under load; aiohttp pools for 15 s, ingress-nginx and AWS
    # load balancers for 60 s. 75 s is nginx's own default; --max-connections bounds the idle ones.
    timeout_keep_alive_s: float = 75.0
    # A connection whose request head has not fully arrived by then is closed (slowloris).
    header_timeout_s: float = 10.0
    # A request whose body has not fully arrived this long after its head gets 408 (a slow POST).
    # The largest body allowed (4 MiB) takes 60 s at 560 kbit/s.
    body_timeout_s: float = 60.0
    # Open connections; beyond them a few for the probes (connections.py), more are closed on arrival.
    # Below a container's usual 1024 descriptors.
    max_connections: int = 512

