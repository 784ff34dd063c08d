"""uvicorn's server with a shutdown that ends, rather than cuts, the requests it cannot finish."""

from __future__ import annotations

import asyncio

import uvicorn

from .async_engine import AsyncEngine


class DrainingServer(uvicorn.Server):
    """On SIGINT/SIGTERM new requests get 503 at once and running ones go on; shortly before
    --graceful-timeout, where uvicorn would cancel them into a plain-text 500 or a cut stream, each is
    ended with an OpenAI error body (or an SSE error event and [DONE])."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop_accepting()
        grace = self.config.timeout_graceful_shutdown
        end = None
        if grace is not None:  # leave the ended responses time to be written before uvicorn cancels
            message = f"the server shut down before this request finished (--graceful-timeout {grace:g} s); retry it"
            end = asyncio.get_running_loop().call_later(max(0.0, grace - min(1.0, grace / 4)), self.engine.end_all,
                                                        message)  # fmt: skip
        try:
            await super().shutdown(sockets)
        finally:
            if end is not None:
                end.cancel()
