"""An Anthropic Messages-API server over real HTTP on 127.0.0.1, answering from a script.

A test gives the replies, in order, as ``(status, body)`` pairs; each ``POST`` takes the next
one, and the server records what it was sent (path, JSON body, ``x-api-key``)::

    server = MessagesServer([(200, message([...], "end_turn", tokens=(12, 5)))])
    ...
    [sent] = server.requests
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MessagesServer:
    def __init__(self, replies: list[tuple[int, dict[str, Any]]]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(
                    {"path": self.path, "body": body, "key": self.headers.get("x-api-key")}
                )
                status, reply = outer.replies.pop(0)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def message(content: list[dict[str, Any]], stop: str, *, tokens: tuple[int, int]) -> dict[str, Any]:
    """A Messages-API answer: ``content`` blocks, the stop reason and (input, output) tokens."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]},
    }
