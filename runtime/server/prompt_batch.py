"""A completions request with a batch of prompts: one stream of choices out of one per prompt.

Choice i of prompt p is numbered p * n + i, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvpilot.runtime.engine.output_processor import StreamOutput

_DONE = object()


async def merged(streams: list[AsyncIterator[StreamOutput]], n: int) -> AsyncIterator[StreamOutput]:
    """Each prompt's outputs as they come, renumbered. Closing it closes every stream, which
    aborts what is unfinished; an error from one stream ends them all."""
    # One slot: a reader that stalls stalls every pump, so each stream's own buffer bound still holds.
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(prompt_index: int, stream: AsyncIterator[StreamOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    output.index += prompt_index * n
                    await queue.put(output)
        except Exception as err:
            await queue.put(err)
        else:
            await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(p, stream)) for p, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
