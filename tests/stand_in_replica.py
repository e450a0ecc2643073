"""A stand-in for a replica's vLLM server in the pool's scheduling tests: it answers at once what the
pool asks a replica (health, its adapters, sleep and wake), so a test decides nothing but time.

    python -m tests.stand_in_replica PORT
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from inference.engine_contract import SLEEP_PATH, WAKE_PATH


class StandIn(BaseHTTPRequestHandler):
    asleep = False

    def do_GET(self) -> None:  # /health, /v1/models (no adapter), the kernels' report
        self._answer({"data": []})

    def do_POST(self) -> None:
        if self.path not in (SLEEP_PATH, WAKE_PATH):
            self.send_error(404)
            return
        StandIn.asleep = self.path == SLEEP_PATH
        self._answer({"asleep": StandIn.asleep})

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    HTTPServer(("127.0.0.1", int(sys.argv[1])), StandIn).serve_forever()
