"""What the bench client does with a stream a server got wrong: each request fails with its
reason, and the run goes on (cluster/bench/client.py `send`). A scripted SSE server on
127.0.0.1 sends one malformed event among good ones."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdserve.cluster.bench.client import RequestRecord, send


async def _serve_events(events: list[bytes]) -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
                     + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"


def _run(events: list[bytes]) -> RequestRecord:
    async def main() -> RequestRecord:
        server, url = await _serve_events(events)
        try:
            async with aiohttp.ClientSession() as client:
                rec = RequestRecord(0, input_len=3, output_len=2, scheduled=0.0)
                return await send(client, url, {"prompt": "x"}, 10.0, rec, 0.0)
        finally:
            server.close()

    return asyncio.run(main())


TOKEN = json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}).encode()


@pytest.mark.parametrize("bad", [
    json.dumps({"choices": {"0": {"text": "a"}}}).encode(),  # a KeyError escaped: the whole run ended
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
    b'"just a string"',
], ids=["choices-not-a-list", "deep-nesting", "not-an-object"])
def test_a_malformed_event_fails_its_request_not_the_run(bad: bytes) -> None:
    rec = _run([TOKEN, bad, TOKEN])
    assert not rec.success and rec.error is not None and rec.error.startswith("bad stream event"), rec.error


def test_counts_that_are_no_counts_are_not_taken() -> None:
    """A usage without completion_tokens (or a string prompt_tokens): the count was 0 tokens
    (throughput 0, TPOT undefined); now the client counts its chunks, as with no usage."""
    for usage in (b'{"prompt_tokens": "3"}', b'{"prompt_tokens": 3, "completion_tokens": null}',
                  b'{"completion_tokens": 1e400}'):  # the last an OverflowError that ended the run
        rec = _run([TOKEN, TOKEN, b'{"choices": [], "usage": ' + usage + b"}"])
        assert rec.success and rec.output_tokens == 2 and not rec.usage_reported, (usage, rec)


def test_without_usage_a_token_counter_counts_the_outputs_text() -> None:
    """A server that sends no usage and several tokens a chunk: counted by chunks, the output was
    4 tokens for 8 (TPOT doubled, throughput halved); vLLM's bench re-tokenizes the text, and so
    does this client when it has the tokenizer (`--tokenizer`)."""
    two_words = json.dumps({"choices": [{"index": 0, "text": " a b", "finish_reason": None}]}).encode()

    async def main() -> RequestRecord:
        server, url = await _serve_events([two_words] * 4)
        try:
            async with aiohttp.ClientSession() as client:
                rec = RequestRecord(0, input_len=3, output_len=8, scheduled=0.0)
                return await send(client, url, {"prompt": "x"}, 10.0, rec, 0.0, lambda text: len(text.split()))
        finally:
            server.close()

    rec = asyncio.run(main())
    assert rec.success and rec.chunks == 4 and rec.output_tokens == 8
    assert _run([two_words] * 4).output_tokens == 4  # no counter: the chunks, as documented
