"""A stand-in for ninfer-serve in the bench's server-lifecycle tests (run as a script).

It takes ninfer-serve's command line (only --port matters), starts a child that sleeps (as a
server's workers would), writes "PID CHILD_PID" to $FAKE_SERVE_PIDS, and then behaves as
$FAKE_SERVE_MODE says:

- ok:       healthy; chat answers a fixed response;
- chat-500: healthy; chat answers HTTP 500 (the bench's warm-up fails);
- hang:     /health answers 503 forever;
- exit:     prints a line and exits with status 3 at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_SERVE_MODE", "ok")
RESPONSE = {
    "id": "chatcmpl-fake", "object": "chat.completion", "model": "fake",
    "choices": [{"index": 0, "finish_reason": "length",
                 "message": {"role": "assistant", "content": "hello", "reasoning_content": None}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            self._send(503 if MODE == "hang" else 200, {})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": "fake"}]})
        else:
            self._send(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if MODE == "chat-500":
            self._send(500, {"error": {"message": "injected failure"}})
        else:
            self._send(200, RESPONSE)

    def log_message(self, *_: object) -> None:
        pass


def main() -> None:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_SERVE_PIDS"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    print("fake server starting", flush=True)
    if MODE == "exit":
        sys.exit(3)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
