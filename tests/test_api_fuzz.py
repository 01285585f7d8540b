"""Schema-driven fuzzing of the scheduler's API (schemathesis) against scripted runners.

The scheduler serves its own OpenAPI document; schemathesis generates valid and invalid
requests for every operation from it and checks each answer: never a 5xx, a documented status
code and content type, and a body that matches the documented schema. Bounded: a fixed number
of examples per operation, derandomized (the same cases every run), no example database.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from api_helpers import Live  # noqa: E402
from fake_runner import FakeRunner  # noqa: E402
from lorafleet.scheduler.limits import RequestLimits  # noqa: E402
from lorafleet.scheduler.registry import AdapterEntry, AdapterRegistry  # noqa: E402
from lorafleet.scheduler.tokenizer import Tokenizer  # noqa: E402

EXAMPLES = 120  # per generating operation and mode; the module takes under a minute on 2 cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class Background:
    """The scheduler and its fake runners on their own event loop in a thread (schemathesis is blocking)."""

    def __init__(self, tok):
        self.tok = tok
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self):
        registry = AdapterRegistry([AdapterEntry("pirate", "/nowhere/pirate"), AdapterEntry("broken", "/x/broken")])
        runners = [FakeRunner("fake-0", max_batch_size=64, refuse={"broken": "DoRA adapters are not supported"}),
                   FakeRunner("fake-1", max_batch_size=64)]
        self.stop = asyncio.Event()
        limits = RequestLimits(max_model_len=512, max_completion_tokens=16)
        async with Live(self.tok, runners, registry, limits=limits) as live:
            self.live = live
            self.ready.set()
            await self.stop.wait()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30), "scheduler did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(autouse=True)
def _store_in_tmp(tmp_path, monkeypatch):
    """schemathesis keeps a cache under `.schemathesis/` of the working directory: a temporary one here."""
    from schemathesis.core import storage

    monkeypatch.setattr(storage, "DEFAULT_ROOT", tmp_path / ".schemathesis")


@pytest.fixture(scope="module")
def served(demo_model):
    with Background(Tokenizer(demo_model)) as bg:
        yield bg


def load(doc: dict, url: str):
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=url, request_timeout=30)
    return schema


@pytest.fixture(scope="module")
def api_schema(served):
    """The scheduler's own document, as served."""
    return load(requests.get(f"{served.live.url}/openapi.json", timeout=10).json(), served.live.url)


@pytest.fixture(scope="module")
def served_models_schema(served):
    """The same document with `model` narrowed to the names served (its `enum` branch), so that valid
    requests reach placement, the runners and the response paths instead of stopping at a 404."""
    doc = requests.get(f"{served.live.url}/openapi.json", timeout=10).json()
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        props["model"] = props["model"]["anyOf"][0]
    return load(doc, served.live.url)


OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model_id}",
              "GET /openapi.json", "GET /healthz", "GET /readyz", "GET /metrics", "GET /admin/state",
              "POST /v1/tokenize", "POST /v1/detokenize", "POST /tokenize", "POST /detokenize"]
# The generating endpoints get the most examples; the small GETs need few to cover their inputs.
EXAMPLES_FOR = {"POST /v1/completions": EXAMPLES, "POST /v1/chat/completions": EXAMPLES}


def test_the_document_lists_every_operation(api_schema):
    labels = sorted(op.ok().label for op in api_schema.get_all_operations())
    assert labels == sorted(OPERATIONS)


WITH_INPUT = ["POST /v1/completions", "POST /v1/chat/completions",  # a path id has no invalid form
              "POST /v1/tokenize", "POST /v1/detokenize"]
CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + \
        [(label, GenerationMode.NEGATIVE) for label in WITH_INPUT]  # no invalid form of an input-less GET


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label, mode", CASES, ids=[f"{m.value}-{label}" for label, m in CASES])
def test_no_input_makes_the_scheduler_fail(api_schema, served, label, mode):
    fuzz_operation(api_schema, served, label, mode, EXAMPLES_FOR.get(label, 10))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label", WITH_INPUT)
def test_valid_requests_for_served_models(served_models_schema, served, label):
    fuzz_operation(served_models_schema, served, label, GenerationMode.POSITIVE, EXAMPLES)


def fuzz_operation(schema, served, label, mode, examples):
    op = schema.find_operation_by_label(label)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(base_url=served.live.url, timeout=30)
        case.validate_response(response, checks=CHECKS)

    fuzz()


def test_fuzzing_left_the_scheduler_clean(served):
    """After the fuzzing: nothing in flight, nothing queued, no unhandled error, no 5xx counted."""
    service = served.live.service
    deadline = time.monotonic() + 10
    while (service.in_flight or service.cluster.queue) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not service.in_flight and not service.cluster.queue
    assert service.metrics.unhandled_errors._value.get() == 0
    text = requests.get(f"{served.live.url}/metrics", timeout=10).text
    fives = [ln for ln in text.splitlines() if ln.startswith("lorafleet_http_requests_total{code=\"5")]
    assert not fives, fives
    counts = {ln.split("{", 1)[1].rsplit("}", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith("lorafleet_http_requests_total{")}
    assert sum(counts.values()) > 300, counts  # the fuzzer really exercised the server
    for route in ("/v1/completions", "/v1/chat/completions"):  # ... including the generating paths
        assert counts.get(f'code="200",route="{route}"', 0) >= 10, counts
        assert counts.get(f'code="400",route="{route}"', 0) >= 10, counts
