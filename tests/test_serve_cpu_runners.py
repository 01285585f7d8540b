"""`lorafleet serve --runners 2` on the CPU divides the machine: each runner's engine gets its share of
the cores as torch threads (two engines each with a thread per core of the same cores ran many times
slower than one), an explicit --threads wins, and 512 concurrent streams through two runners all
complete, spread over both."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from lorafleet.common.cpus import available_cpus, cgroup_cpu_limit, split
from lorafleet.serve import runner_command
from serve_helpers import Served

STREAMS = 512


def serve_args(**kw) -> argparse.Namespace:
    base = dict(log_level="INFO", max_batch_size=32, max_lora_rank=64, dtype="auto", grace_seconds=20.0, kv_pages=None,
                page_size=None, kv_cache_gb=None, runners=1, threads=None)
    return argparse.Namespace(**{**base, **kw})


def threads_of(cmd: list[str]) -> int | None:
    return int(cmd[cmd.index("--threads") + 1]) if "--threads" in cmd else None


def test_cpu_runners_split_the_cores_and_an_explicit_setting_wins():
    cpus = available_cpus()
    for n in (1, 2, 3, cpus * 2):
        cmd = runner_command(serve_args(runners=n), "m", 1, "runner-0", "cpu")
        assert threads_of(cmd) == max(1, cpus // n) == split(cpus, n)
    assert threads_of(runner_command(serve_args(runners=2, threads=3), "m", 1, "r", "cpu")) == 3
    assert threads_of(runner_command(serve_args(runners=2, threads=3), "m", 1, "r", "cuda:0")) == 3
    assert threads_of(runner_command(serve_args(runners=2), "m", 1, "r", "cuda:0")) is None  # GPUs: torch's own


def test_cgroup_cpu_limit_caps_the_count(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert available_cpus(tmp_path) == min(2, available_cpus())  # 1.5 CPUs round up to 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(v1) == 1.0 and available_cpus(v1) == 1


def runner_cmdlines(served: Served) -> list[list[str]]:
    out = []
    for pid in served.children():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "runner" in cmd:
            out.append(cmd)
    return out


async def stream_all(url: str, n: int) -> list[tuple[int, str | None, bool]]:
    """n streaming completions at once -> per stream (text chunks, finish_reason, saw [DONE])."""
    async def one(session: aiohttp.ClientSession, i: int):
        body = {"model": "tiny", "prompt": f"Count with me: {i}", "max_tokens": 4, "stream": True,
                "temperature": 0, "ignore_eos": True}
        chunks, finish, done = 0, None, False
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                choice = json.loads(line[6:])["choices"][0]
                chunks += bool(choice.get("text"))
                finish = choice.get("finish_reason") or finish
        return chunks, finish, done

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_512_streams_through_two_cpu_runners_all_complete(tiny_chat_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_LOG_LEVEL", "WARNING")
    served = Served(tiny_chat_llama, tmp_path, "--model-name", "tiny", "--max-batch-size", "32", runners=2)
    log: list[str] = []  # read as it comes: a full pipe would stall the server
    threading.Thread(target=lambda: log.extend(served.proc.stdout), daemon=True).start()
    try:
        served.wait_ready()
        cmds = runner_cmdlines(served)
        assert len(cmds) == 2 and all(threads_of(c) == split(available_cpus(), 2) for c in cmds), cmds
        results = asyncio.run(stream_all(served.url, STREAMS))
        assert len(results) == STREAMS
        incomplete = [i for i, (chunks, finish, done) in enumerate(results) if not done or finish != "length"]
        assert not incomplete, f"{len(incomplete)} streams did not complete, e.g. {results[incomplete[0]]}"
        assert all(chunks >= 1 for chunks, _, _ in results)
        metrics = urllib.request.urlopen(f"{served.url}/metrics", timeout=10).read().decode()
        busy = dict(re.findall(r'lorafleet_runner_busy_seconds_total\{runner="([^"]+)"\} ([0-9.e+-]+)', metrics))
        assert set(busy) == {"runner-0", "runner-1"} and all(float(v) > 0 for v in busy.values()), busy
        sequences = re.search(r'lorafleet_model_sequences_total\{model="tiny"\} ([0-9.e+]+)', metrics)
        assert sequences and float(sequences.group(1)) == STREAMS
    finally:
        code = served.stop()
    assert code == 0, "".join(log)[-3000:]
