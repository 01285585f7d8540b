"""The scheduler's stop on SIGTERM (SchedulerService.stop, `--grace-seconds`): requests in flight get the grace
period, then each one still waiting is answered at once (503, `cancelled`, Retry-After) instead of hanging until
the server drops the connection; the operator gives the scheduler pod at least the runners' grace period and the
scheduler a shorter wait, so it ends what is left itself before the kubelet's SIGKILL."""

from __future__ import annotations

import asyncio
import time

import pytest
from api_helpers import start, stop
from fake_runner import FakeRunner

from lorafleet.operator import builders
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.spec import parse_pool
from lorafleet.scheduler import server


async def test_requests_still_in_flight_when_the_grace_period_ends_are_answered_at_once(tok):
    """One slow request on the only runner (one row at a time) and more queued behind it: after the grace period
    every one is answered 503 at once, the queued ones too (nothing had finished them: they have no runner)."""
    fr = FakeRunner(max_batch_size=1, step_s=0.2)  # 100 tokens would take 20 s
    client, service, servers = await start(tok, [fr], grace_seconds=0.5)
    try:
        body = {"model": "base", "prompt": "x", "max_tokens": 100}
        posts = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(6)]
        for _ in range(300):
            if len(service.in_flight) == 6 and service.cluster.queue:
                break
            await asyncio.sleep(0.01)
        assert len(service.in_flight) == 6 and service.cluster.queue, (len(service.in_flight), service.cluster.queue)
        t0 = time.monotonic()
        await service.stop(None)
        answers = await asyncio.wait_for(asyncio.gather(*posts), 5)
        waited = time.monotonic() - t0
        for r in answers:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "cancelled" and r.headers["Retry-After"] == "5"
        assert 0.4 <= waited < 3, waited  # the grace period, then no longer
        assert not service.in_flight and not service.cluster.queue
    finally:
        await stop(client, servers)


def test_grace_seconds_is_parsed_and_bounded(capsys):
    import argparse

    p = argparse.ArgumentParser()
    server.add_arguments(p)
    base = ["--model", "m"]
    assert p.parse_args(base).grace_seconds == 30.0
    assert p.parse_args(base + ["--grace-seconds", "110"]).grace_seconds == 110.0
    for bad, words in (("-1", "must be 0 to 3600 seconds"), ("soon", "not a number of seconds")):
        with pytest.raises(SystemExit):
            p.parse_args(base + ["--grace-seconds", bad])
        assert words in capsys.readouterr().err
    assert "default: 30" in p.format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("grace, sched, sched_wait, runner_wait", [(None, 120, 110, 110), (600, 600, 590, 590),
                                                                   (10, 120, 110, 5)])
def test_the_scheduler_pod_waits_at_least_as_long_as_the_runners(grace, sched, sched_wait, runner_wait):
    """The scheduler pod's grace period is the runners' or 120 s, whichever is longer; each waits 10 s less."""
    runner = {} if grace is None else {"terminationGracePeriodSeconds": grace}
    pool = parse_pool("p", "ns", {"model": {"source": "hf://org/model"}, "runner": runner})
    spec = builders.scheduler_deployment(pool, OperatorConfig())["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert spec["terminationGracePeriodSeconds"] == sched and pool.runner.grace_seconds == (grace or 120)
    assert args[args.index("--grace-seconds") + 1] == str(sched_wait)
    runner_args = builders.runner_args(pool)
    assert runner_args[runner_args.index("--grace-seconds") + 1] == str(runner_wait)
