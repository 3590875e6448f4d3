"""The supervisor counts a service ready only when its own process answers on the port."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from torchrelay.stack import _ready


@pytest.fixture
def readyz() -> Iterator[int]:
    """An HTTP server answering ``/readyz`` 200 with pid 4242 (another process's)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"ready": True, "pid": 4242}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_ready_only_from_the_expected_pid(readyz: int) -> None:
    assert _ready(readyz, 4242)
    # Another process that took the port the supervisor chose is not our service.
    assert not _ready(readyz, 4243)
    assert not _ready(readyz, None)
