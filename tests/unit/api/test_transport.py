"""One write per response: the gathering transport under uvicorn's HTTP protocol."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import httpx
import pytest
import uvicorn

from services.api.transport import FLUSH_BYTES, GatheringTransport, http_protocol


class Recorded(asyncio.Transport):
    """A transport that records writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False
        self.aborted = False
        self.protocol: asyncio.BaseProtocol | None = None

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_writes_of_one_loop_step_go_out_as_one() -> None:
    inner = Recorded()
    gathering = GatheringTransport(inner, asyncio.get_running_loop())
    gathering.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    gathering.write(bytearray(b"bo"))
    gathering.writelines([b"d", b"y"])
    assert inner.writes == []
    assert gathering.get_write_buffer_size() == 42
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
    gathering.write(b"next")
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"next"]
    assert gathering.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_a_large_write_goes_out_at_once() -> None:
    inner = Recorded()
    gathering = GatheringTransport(inner, asyncio.get_running_loop())
    gathering.write(b"head")
    gathering.write(b"x" * FLUSH_BYTES)
    assert inner.writes == [b"head" + b"x" * FLUSH_BYTES]
    await asyncio.sleep(0)
    assert len(inner.writes) == 1


async def test_close_writes_first_abort_and_a_gone_peer_drop() -> None:
    loop = asyncio.get_running_loop()
    inner = Recorded()
    gathering = GatheringTransport(inner, loop)
    gathering.write(b"last words")
    gathering.close()
    assert inner.writes == [b"last words"]
    assert gathering.is_closing()

    inner = Recorded()
    gathering = GatheringTransport(inner, loop)
    gathering.write(b"never sent")
    gathering.abort()
    await asyncio.sleep(0)
    assert inner.writes == []
    assert inner.aborted

    inner = Recorded()
    gathering = GatheringTransport(inner, loop)
    gathering.write(b"too late")
    inner.closing = True  # the peer went away within the step
    await asyncio.sleep(0)
    assert inner.writes == []


async def test_a_new_protocol_follows_what_the_old_one_wrote() -> None:
    inner = Recorded()
    gathering = GatheringTransport(inner, asyncio.get_running_loop())
    gathering.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    new = asyncio.Protocol()
    gathering.set_protocol(new)
    assert inner.writes == [b"HTTP/1.1 101 Switching Protocols\r\n\r\n"]
    assert inner.protocol is new


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(50):
            chunk = str(i).encode() * 20_000
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b""})
        return
    body = scope["path"].encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("blocked", [(), ("httptools",)])
async def test_uvicorn_over_it_answers_keep_alive_pipelined_and_streamed_requests(
    blocked: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in blocked:  # as if not installed
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, "uvicorn.protocols.http.httptools_impl", raising=False)
    protocol, parser = http_protocol()
    assert parser == ("h11" if blocked else "httptools")
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=0, http=protocol, log_config=None, lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for path in ("/a", "/bb", "/ccc"):  # one keep-alive connection
                r = await http.get(path)
                assert (r.status_code, r.content) == (200, path.encode())
            streamed = await http.get("/stream")
            assert streamed.content == b"".join(str(i).encode() * 20_000 for i in range(50))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\nGET /two HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = b""
        while answers.count(b"HTTP/1.1 200") < 2 or not answers.endswith(b"/two"):
            answers += await asyncio.wait_for(reader.read(65536), 10)
        assert answers.index(b"/one") < answers.index(b"/two")
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
