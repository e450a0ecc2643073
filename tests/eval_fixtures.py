"""A stand-in for the serving engine (the embedded pool or Ray Serve) that eval runs and the gate
answer through: a plain HTTP server that answers chat completions as a tiny, predictable model
would, and records what it was sent. No vLLM engine starts (the real engine's runs are the lead's
``engine`` tests)."""

from __future__ import annotations

import http.server
import json
import re
import threading
from dataclasses import dataclass, field

import pytest

from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER
from tests.personas import chat_example, jsonl

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo"}
REFUSED = "Tell me something too long to answer"  # the stand-in refuses this prompt, as vLLM refuses one over the context


def capitals_file(*extra: dict, rounds: int = 2) -> bytes:
    """The five capitals asked ``rounds`` times (an upload needs 10 examples), then any ``extra``."""
    questions = [chat_example(f"What is the capital of {country}?", f"{capital}.") for country, capital in CAPITALS.items()]
    return jsonl([*questions * rounds, *extra])


# The evaluation gate's files: twelve capitals, each answered as ``answer`` says.
TWELVE_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "the United Kingdom": "London", "Egypt": "Cairo", "Russia": "Moscow", "China": "Beijing",
    "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
}


def capitals(answer=lambda capital: f"{capital}.") -> bytes:
    return jsonl([chat_example(f"What is the capital of {country}?", answer(capital)) for country, capital in TWELVE_CAPITALS.items()])


@dataclass
class StandInEngine:
    """Answers like a model that knows the capitals only as a fine-tune (any model name with a
    ``:``, or a mix), and says "I do not know." as the base model; a prompt naming ``REFUSED`` is a
    400 in vLLM's words. ``bodies`` and ``paths`` are what it was sent, in order."""

    url: str = ""
    bodies: list[dict] = field(default_factory=list)
    organizations: list[str] = field(default_factory=list)
    background: list[bool] = field(default_factory=list)  # whether each was marked as background work
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer_to(self, body: dict) -> tuple[int, dict]:
        question = body["messages"][-1]["content"] if "messages" in body else body["prompt"]  # chat, or completions
        if verdict := _judged(body.get("response_format")):
            return 200, _chat(body["model"], json.dumps(verdict))
        if REFUSED in question:
            return 400, {"error": {"message": "This model's maximum context length is 2048 tokens.", "type": "BadRequestError", "code": 400}}
        knows = ":" in body["model"] or bool(body.get("adapters"))
        country = re.search(r"capital of (.+)\?", question)
        content = f"{CAPITALS.get(country.group(1), 'Nowhere')}." if knows and country else "I do not know."
        usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
        name = f"{body['model']}@r1" if ":" in body["model"] and "@" not in body["model"] else body["model"]
        if "messages" not in body:
            choice = {"index": 0, "text": content, "finish_reason": "stop"}
            return 200, {"object": "text_completion", "model": name, "choices": [choice], "usage": usage}
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        return 200, {"object": "chat.completion", "model": name, "choices": [choice], "usage": usage}


def _judged(response_format: object) -> dict | None:
    """A model grader's verdict, as a judge under structured outputs gives one: the first label (a
    label_model's), or the top of the range (a score_model's); None for any other request."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    properties = response_format["json_schema"]["schema"].get("properties", {})
    if "label" in properties:
        return {"label": properties["label"]["enum"][0]}
    if "result" in properties:
        return {"result": properties["result"].get("maximum", 1)}
    return None


def _chat(model: str, content: str) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    return {"object": "chat.completion", "model": model, "choices": [choice], "usage": usage}


def start_stand_in(engine: StandInEngine) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the platform's client expects

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with engine.lock:
                engine.bodies.append(body | {"_path": self.path})
                engine.organizations.append(self.headers.get(ORGANIZATION_HEADER, ""))
                engine.background.append(BACKGROUND_HEADER in self.headers)
            status, answer = engine.answer_to(body)
            raw = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    engine.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def engine(settings):
    """The stand-in engine, as the embedded pool."""
    stand_in = StandInEngine()
    server = start_stand_in(stand_in)
    settings.INFERENCE_POOL_URL = stand_in.url
    yield stand_in
    server.shutdown()
    server.server_close()


@pytest.fixture
def queued(monkeypatch) -> list[str]:
    """The eval runs sent to the default queue; the test runs them itself (``workers.run_eval.run_eval``)."""
    sent: list[str] = []
    monkeypatch.setattr("evals.creation.send_to_worker", sent.append)
    return sent
