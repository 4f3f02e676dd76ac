"""A stand-in for a prefill + decode pair whose answers to one tenant never end, so a test can
hold that tenant's requests in flight at a real router for as long as it looks. Another
tenant's answers end at once. The router calls it for both roles (the paths differ).

    python slow_engine.py PORT SLOW_TENANT
"""

import asyncio
import sys
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kvfence_engine.contracts import (
    AbortBody,
    AbortReply,
    DecodeBody,
    DeltaLine,
    FirstToken,
    PrefillBody,
    PrefillReply,
    ReserveBody,
    ReserveReply,
)

TOKEN = 42


def create(slow_tenant: str) -> FastAPI:
    app = FastAPI()

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/internal/reserve")
    async def reserve(body: ReserveBody) -> ReserveReply:
        n = len(body.prompt_ids)
        return ReserveReply(
            request_id=body.request_id,
            seq_id=1,
            pages=[0],
            tags=[1],
            reserved_tokens=n,
            transfer_port=1,
            max_tokens=body.max_tokens or 16,
        )

    @app.post("/internal/prefill")
    async def prefill(body: PrefillBody) -> PrefillReply:
        n = len(body.prompt_ids)
        return PrefillReply(first=FirstToken(token_id=TOKEN), prompt_tokens=n, kv_tokens=n)

    @app.post("/internal/decode")
    async def decode(body: DecodeBody) -> StreamingResponse:
        slow = body.request_id.startswith(slow_tenant + "-")

        async def lines() -> AsyncIterator[str]:
            yield DeltaLine(token_ids=[TOKEN], logprobs=[]).model_dump_json() + "\n"
            while slow:  # until the router hangs up
                await asyncio.sleep(0.05)
                yield DeltaLine(token_ids=[TOKEN], logprobs=[]).model_dump_json() + "\n"
            last = DeltaLine(token_ids=[TOKEN], logprobs=[], finish_reason="length")
            yield last.model_dump_json() + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/internal/abort")
    async def abort(body: AbortBody) -> AbortReply:
        return AbortReply(aborted=True)

    return app


if __name__ == "__main__":
    uvicorn.run(create(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
