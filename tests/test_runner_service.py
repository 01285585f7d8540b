"""The runner's HTTP service in-process: streaming, cancel, disconnect, state, validation."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_helpers import write_random_adapter
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine import Engine
from lorafleet.runner.server import RunnerService, create_app


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return write_random_adapter(tiny_llama, tmp_path_factory.mktemp("ad") / "ad", r=8, seed=3)


@pytest.fixture
async def client(tiny_llama):
    service = RunnerService(lambda: Engine(str(tiny_llama), EngineConfig(page_size=4, num_pages=256, max_batch_size=8,
                                                                        max_lora_rank=16)), "runner-test")
    async with TestClient(TestServer(create_app(service))) as c:
        for _ in range(100):
            if (await c.get("/readyz")).status == 200:
                break
            await asyncio.sleep(0.05)
        yield c


async def generate(client, body):
    resp = await client.post("/v1/generate", json=body)
    assert resp.status == 200, await resp.text()
    lines = [json.loads(x) for x in (await resp.text()).splitlines() if x.strip()]
    return lines


async def test_stream_tokens_then_final(client, adapter):
    body = {"request_id": "a", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 5, "ignore_eos": True},
            "adapter": {"name": "ad", "source": str(adapter)}}
    lines = await generate(client, body)
    streamed = [t for ln in lines[:-1] for t in ln["token_ids"]]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["output_token_ids"] == streamed and len(streamed) == 5
    state = await (await client.get("/state")).json()
    assert state["id"] == "runner-test" and state["free_kv_tokens"] == state["total_kv_tokens"]
    assert "ad" in state["resident_adapters"]


async def test_bad_requests_are_400(client):
    for body, word in [({}, "request_id"), ({"request_id": "x", "prompt_token_ids": []}, "prompt_token_ids"),
                       ({"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": 0}}, "max_tokens"),
                       ({"request_id": "x", "prompt_token_ids": [1], "sampling": {"top_p": 5}}, "top_p"),
                       ({"request_id": "x", "prompt_token_ids": [1], "adapter": "oops"}, "adapter")]:
        resp = await client.post("/v1/generate", json=body)
        assert resp.status == 400 and word in (await resp.json())["error"]
    resp = await client.post("/v1/generate", data=b"{nope", headers={"Content-Type": "application/json"})
    assert resp.status == 400


async def test_bad_adapter_is_an_error_event(client, tmp_path):
    lines = await generate(client, {"request_id": "b", "prompt_token_ids": [1, 2],
                                    "adapter": {"name": "ghost", "source": str(tmp_path / "ghost")}})
    assert lines[-1]["finish_reason"] == "error" and "ghost" in lines[-1]["error"]


async def test_disconnect_cancels_and_frees_pages(client):
    body = {"request_id": "long", "prompt_token_ids": list(range(3, 40)),
            "sampling": {"max_tokens": 400, "ignore_eos": True}}
    resp = await client.post("/v1/generate", json=body)
    await resp.content.readline()  # first tokens arrived: it is running
    resp.close()  # client goes away
    for _ in range(50):
        st = await (await client.get("/state")).json()
        if st["free_kv_tokens"] == st["total_kv_tokens"] and st["batch_size"] == 0:
            break
        await asyncio.sleep(0.02)
    assert st["free_kv_tokens"] == st["total_kv_tokens"] and st["batch_size"] == 0


async def test_explicit_cancel(client):
    body = {"request_id": "c1", "prompt_token_ids": [3, 4], "sampling": {"max_tokens": 400, "ignore_eos": True}}
    resp = await client.post("/v1/generate", json=body)
    await resp.content.readline()
    r = await client.post("/v1/cancel/c1")
    assert (await r.json())["cancelled"] is True
    lines = [json.loads(x) for x in (await resp.text()).splitlines() if x.strip()]
    assert lines[-1]["finish_reason"] == "cancelled"


async def test_validate_endpoint(client, adapter, tmp_path):
    ok = await (await client.post("/v1/adapters/validate", json={"name": "ad", "source": str(adapter)})).json()
    assert ok["ok"] and ok["rank"] == 8 and set(ok["target_modules"]) == {"q", "v"}
    bad = await (await client.post("/v1/adapters/validate", json={"name": "x", "source": str(tmp_path)})).json()
    assert not bad["ok"] and "adapter_config.json" in bad["error"]


async def test_metrics_expose_gateway_shape(client, adapter):
    await generate(client, {"request_id": "m", "prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2},
                            "adapter": {"name": "ad", "source": str(adapter)}})
    text = await (await client.get("/metrics")).text()
    assert "vllm:lora_requests_info{" in text and 'max_lora="' in text
    assert "lorafleet_runner_generated_tokens_total" in text
