"""Stand-ins for llama-server where the real one cannot produce the condition on demand: a stream
that trickles for as long as a test needs, and a connection that breaks before any response byte."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def sse_chunk(text: str) -> bytes:
    event = {
        "id": "chatcmpl-standin",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "demo",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class TrickleLlama:
    """An OpenAI-style SSE stream of `events` pieces, one every `interval_s` (`events` 0: without end),
    for any streaming POST; a blocking POST is never answered (a long generation). GET /health is 200."""

    def __init__(self, events: int = 0, interval_s: float = 0.1) -> None:
        self.events = events
        self.interval_s = interval_s
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                body = b'{"status":"ok"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                if not body.get("stream"):
                    time.sleep(3600)  # never answers; the thread dies with the process
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                sent = 0
                try:
                    while not outer.events or sent < outer.events:
                        self._chunk(sse_chunk(f"t{sent} "))
                        sent += 1
                        time.sleep(outer.interval_s)
                    self._chunk(b"data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    return  # the gateway closed the stream

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ResetBeforeAnswer:
    """Accepts each connection, reads the request head, and resets it (RST) without a byte of answer:
    a llama that crashed while taking the request."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.accepted = 0
        self.closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.settimeout(5)
            try:
                conn.recv(65536)
            except OSError:
                pass
            # linger 0: close() sends RST instead of FIN
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()
