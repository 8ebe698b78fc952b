"""Concurrent requests share target forwards, through a real server and the official async `openai` client.

At temperature 0 each concurrent request gets the text it gets alone, whatever else runs beside it; a
client that hangs up mid-stream leaves the others' answers unchanged; the server's own metrics show that
forwards really were shared.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.api.conftest import API_KEYS, Server

# Mixed prompt lengths and methods (csd is left out of the equality check: its rescues depend on what the
# shared OCM learnt from the other requests a moment before, which is the point of a shared OCM).
REQUESTS = [
    ("Write the days of the week, one per line.", "sd"),
    ("Hi!", "vanilla"),
    (
        "Rewrite in American spelling: The colour of the theatre's centre stage was grey, and the "
        "organisers apologised for the delay of the programme. The neighbours' favourite flavour of "
        "the summer was catalogued by the travellers.",
        "lossy",
    ),
    ("Copy exactly: the cat sat on the mat, the cat sat on the mat.", "sd"),
    ("Name three colours, separated by commas.", "vanilla"),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(api_server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=300
    )


async def stream_text(
    client: openai.AsyncOpenAI, prompt: str, method: str, stop_after: int | None = None
) -> str:
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"speculative": {"method": method}},
    )
    text, chunks = "", 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                await stream.close()  # the client hangs up mid-generation
                break
    return text


def test_concurrent_requests_get_their_alone_answers_and_share_forwards(client, api_server: Server) -> None:
    async def scenario():
        alone = [await stream_text(client, p, m) for p, m in REQUESTS]
        before = await asyncio.to_thread(api_server.metrics)
        together = await asyncio.gather(
            *(stream_text(client, p, m) for p, m in REQUESTS),
            # a csd request and one that hangs up after two chunks run in the same batch
            stream_text(client, REQUESTS[0][0], "csd"),
            stream_text(client, REQUESTS[2][0], "sd", stop_after=2),
        )
        return alone, before, list(together), await asyncio.to_thread(api_server.metrics)

    alone, before, together, after = asyncio.run(scenario())
    assert all(alone), alone
    assert together[: len(REQUESTS)] == alone
    assert together[len(REQUESTS)]  # the csd row finished with text
    # forwards were shared: batched forwards carried several rows on average while the seven ran
    forwards = after.value("csd_batch_rows_count") - before.value("csd_batch_rows_count")
    rows = after.value("csd_batch_rows_sum") - before.value("csd_batch_rows_sum")
    assert forwards > 0 and rows / forwards > 1.5, (rows, forwards)  # about 3 measured here
