"""`lorafleet runner` with a model it cannot load exits with status 2 and one error line naming the cause, instead
of answering unhealthy forever; an engine core that dies after a successful start leaves the runner up to say why."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from runner_helpers import Stream
from lorafleet.runner.service import server
from lorafleet.runner.service.engine_client import EngineClient

pytestmark = pytest.mark.timeout(60)


def bad_models(root, tiny_llama) -> dict[str, tuple]:
    """name -> (model path, words the error must contain)."""
    corrupt = root / "corrupt-config"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama", ')
    alien = root / "unsupported"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"model_type": "gpt9000", "architectures": ["Gpt9000ForCausalLM"]}))
    torn = root / "unreadable-weights"
    torn.mkdir()
    shutil.copy(tiny_llama / "config.json", torn / "config.json")
    (torn / "model.safetensors").write_bytes(b"\xff" * 64)
    return {"missing": (root / "nowhere", ["does not exist"]),
            "corrupt config": (corrupt, ["config.json", "not valid JSON"]),
            "unsupported": (alien, ["Gpt9000ForCausalLM", "not supported"]),
            "unreadable weights": (torn, ["model.safetensors"])}


def test_a_model_that_cannot_be_loaded_makes_the_runner_exit_2_with_the_reason(tmp_path, tiny_llama):
    cases = bad_models(tmp_path, tiny_llama)
    procs = {name: subprocess.Popen([sys.executable, "-m", "lorafleet", "runner", "--model", str(path), "--port", "0",
                                     "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (path, _) in cases.items()}  # side by side: each mostly waits for its engine core to import
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=40)
            errors = [line for line in out.splitlines() if " ERROR " in line]
            assert proc.returncode == 2, (name, out)
            assert len(errors) == 1 and "could not start" in errors[0] and "exiting with status 2" in errors[0], out
            assert all(word in errors[0] for word in cases[name][1]), (name, errors[0])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def test_an_engine_core_that_dies_after_start_leaves_the_runner_up(tiny_llama, monkeypatch):
    monkeypatch.setenv("LORAFLEET_ENGINE_FAULT", "step:1")
    cfg = {"page_size": 4, "num_pages": 64, "max_batch_size": 4, "max_lora_rank": 8, "device": "cpu"}
    service = server.RunnerService(EngineClient(str(tiny_llama), cfg, log_level="WARNING"), "runner-test",
                                   grace_seconds=5, exit_on_start_failure=True)
    async with TestClient(TestServer(server.create_app(service))) as c:
        for _ in range(600):
            if (await c.get("/readyz")).status == 200 or service.engine.error:
                break
            await asyncio.sleep(0.05)
        assert service.engine.ready, service.engine.error
        s = await Stream(c).open()
        await s.submit({"request_id": "f", "prompt_token_ids": [3, 4], "sampling": {"max_tokens": 4}})
        got = await s.until_finished({"f"})
        assert got["f"]["finish"] == "aborted" and "injected engine fault" in got["f"]["error"]
        await asyncio.sleep(server.START_FAILURE_LINGER_S + 0.5)  # an exit would have stopped this loop by now
        h = await c.get("/healthz")
        assert h.status == 500 and "injected engine fault" in (await h.json())["error"]
        assert service.exit_status == 0
