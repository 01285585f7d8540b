"""The scheduler's side of the prefix cache against scripted runners with a cache (`CachingFakeRunner`):
`cache_salt` (validated, passed on, mixed with the API key's salt), `usage.prompt_tokens_details.cached_tokens`
(streaming and not, several prompts and choices, kept across a migration), the pool's prefix cache counters,
and the prefix index behind placement."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from api_helpers import start, stop
from fake_runner import CachingFakeRunner
from lorafleet.scheduler.api_keys import ApiKeyFileError, ApiKeys, cache_salt, parse_keys
from lorafleet.scheduler.openai_api import MAX_CACHE_SALT

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(100, 150))  # 50 tokens: three full 16-token pages before its last token
CACHED = 48


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion(prompt=PROMPT, **kw) -> dict:
    return {"model": "pirate", "prompt": prompt, "max_tokens": 3, **kw}


async def cached_tokens(client, body: dict, headers: dict | None = None, chat: bool = False) -> int:
    r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body, headers=headers)
    got = await r.json()
    assert r.status == 200, got
    return got["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
async def caching(tok):
    fr = CachingFakeRunner()
    client, service, servers = await start(tok, [fr])
    yield client, service, fr
    await stop(client, servers)


# -- cache_salt --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("salt", ["", 7, ["a"], {"a": 1}, True, "x" * (MAX_CACHE_SALT + 1)])
@pytest.mark.parametrize("chat", [False, True])
async def test_a_bad_cache_salt_is_a_400_naming_the_field(caching, salt, chat):
    client, _, fr = caching
    body = ({"model": "base", "messages": [{"role": "user", "content": "hi"}]} if chat
            else {"model": "base", "prompt": "hi"})
    r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json={**body, "cache_salt": salt})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "cache_salt" and "cache_salt" in err["message"], err
    assert not fr.seen


async def test_cache_salt_reaches_the_runner_hashed_and_separates_the_cache(caching):
    client, _, fr = caching
    assert await cached_tokens(client, completion()) == 0
    assert "cache_salt" not in fr.seen[-1]  # no salt: nothing sent, the cache is shared
    assert await cached_tokens(client, completion()) == CACHED
    assert await cached_tokens(client, completion(cache_salt="tenant-a")) == 0  # another salt: no hit
    sent = fr.seen[-1]["cache_salt"]
    assert sent != "tenant-a" and sent == cache_salt(None, "tenant-a")
    assert await cached_tokens(client, completion(cache_salt="tenant-a")) == CACHED
    assert fr.seen[-1]["cache_salt"] == sent
    assert await cached_tokens(client, completion(cache_salt="x" * MAX_CACHE_SALT)) == 0
    assert len(fr.seen[-1]["cache_salt"]) <= MAX_CACHE_SALT  # what a runner accepts, whatever the client sent
    # chat requests carry it too
    chat = {"model": "pirate", "messages": [{"role": "user", "content": "tell me a long story " * 4}], "max_tokens": 2}
    assert await cached_tokens(client, chat, chat=True) == 0
    assert await cached_tokens(client, chat, chat=True) > 0
    assert await cached_tokens(client, {**chat, "cache_salt": "t"}, chat=True) == 0


def test_key_salts_are_one_way_distinct_and_never_equal_a_request_salt():
    keys = parse_keys("key-a\nkey-b\nkey-c cache_group=team\nkey-d pirate cache_group=team\n", salt_per_key=True)
    salts = [g.cache_salt for g in keys.values()]
    assert salts[0] != salts[1] and salts[2] == salts[3] and salts[0] not in salts[2:]
    assert all(s and "key-" not in s and "team" not in s for s in salts)
    assert [sorted(g.models or []) for g in keys.values()] == [[], [], [], ["pirate"]]
    # without the flag only grouped keys are salted
    assert [g.cache_salt is None for g in parse_keys("key-a\nkey-c cache_group=team\n").values()] == [True, False]
    # a client's own salt cannot name a key's or a group's (every salt is a hash of both parts)
    assert cache_salt(None, salts[0]) != salts[0] and cache_salt(None, salts[0]) != cache_salt(salts[0], None)
    assert cache_salt(None, None) is None
    for text, words in [("k cache_group=", "empty cache_group"), ("k colour=red", "unknown option 'colour'"),
                        ("k a b", "line 1"), ("k cache_group=x cache_group=y", "line 1")]:
        with pytest.raises(ApiKeyFileError, match=words):
            parse_keys(text)


async def test_salt_per_key_keeps_tenants_apart_and_groups_together(tok, tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("alice-key\nbob-key\ncarol-key cache_group=team\ndave-key cache_group=team\n")
    fr = CachingFakeRunner()
    client, _, servers = await start(tok, [fr], api_keys=ApiKeys(path, salt_per_key=True))
    caplog.set_level(logging.DEBUG)
    try:
        assert await cached_tokens(client, completion(), bearer("alice-key")) == 0
        assert await cached_tokens(client, completion(), bearer("alice-key")) == CACHED
        assert await cached_tokens(client, completion(), bearer("bob-key")) == 0  # bob cannot see alice's prompt
        assert await cached_tokens(client, completion(cache_salt="s"), bearer("bob-key")) == 0
        assert await cached_tokens(client, completion(cache_salt="s"), bearer("alice-key")) == 0  # same salt, other key
        assert await cached_tokens(client, completion(), bearer("carol-key")) == 0
        assert await cached_tokens(client, completion(), bearer("dave-key")) == CACHED  # one group, one cache
        salts = {b.get("cache_salt") for b in fr.seen}
        assert None not in salts and len(salts) == 5
    finally:
        await stop(client, servers)
    logged = caplog.text + json.dumps([b.get("cache_salt") for b in fr.seen])
    assert "alice-key" not in logged and "bob-key" not in logged
    assert not any(s in caplog.text for s in salts)


async def test_without_salting_keys_share_the_cache(tok, tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice-key\nbob-key\n")
    fr = CachingFakeRunner()
    client, _, servers = await start(tok, [fr], api_keys=ApiKeys(path))
    try:
        assert await cached_tokens(client, completion(), bearer("alice-key")) == 0
        assert await cached_tokens(client, completion(), bearer("bob-key")) == CACHED
    finally:
        await stop(client, servers)


def test_cache_salt_per_key_without_keys_stops_the_scheduler(tmp_path, demo_model):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LORAFLEET_API_KEYS_FILE"}
    r = subprocess.run([sys.executable, "-m", "lorafleet", "scheduler", "--model", str(demo_model), "--port", "0",
                        "--cache-salt-per-key"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--cache-salt-per-key needs API keys" in r.stderr and "Traceback" not in r.stderr


# -- usage.prompt_tokens_details.cached_tokens ----------------------------------------------------------------


async def test_usage_reports_cached_tokens_per_prompt(caching):
    client, _, _ = caching
    other = list(range(300, 340))  # 40 tokens: two full pages
    assert await cached_tokens(client, completion([PROMPT, other])) == 0
    # both prompts again, plus a third that is new: the cached tokens of the two add up
    assert await cached_tokens(client, completion([PROMPT, other, list(range(600, 620))])) == CACHED + 32
    # n choices of one prompt count once, like prompt_tokens (the most any choice found)
    r = await (await client.post("/v1/completions", json=completion(n=3, temperature=0.5, seed=1))).json()
    assert r["usage"]["prompt_tokens"] == len(PROMPT)
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}


@pytest.mark.parametrize("chat", [False, True])
async def test_the_final_usage_chunk_of_a_stream_reports_cached_tokens(caching, chat):
    client, _, _ = caching
    body = ({"model": "pirate", "messages": [{"role": "user", "content": "a longer question " * 6}]} if chat
            else completion())
    body.update(max_tokens=3, stream=True, stream_options={"include_usage": True})
    usages = []
    for _ in range(2):
        text = await (await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)).text()
        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        assert all("usage" not in e for e in events[:-1]) and events[-1]["choices"] == []
        usages.append(events[-1]["usage"])
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    n = usages[1]["prompt_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0


async def test_a_runner_that_reports_nothing_gives_zero(tok):
    fr = CachingFakeRunner(report_cached=False)
    client, _, servers = await start(tok, [fr])
    try:
        for _ in range(2):
            assert await cached_tokens(client, completion()) == 0
    finally:
        await stop(client, servers)


class EvictingRunner(CachingFakeRunner):
    """Evicts every request once, right after its first token (which carries its cached tokens)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.evicted: set[str] = set()  # requests (scheduler ids) evicted once
        self.evicting: set[str] = set()  # runner request ids to end as evicted

    async def generate(self, request):
        rid = (await request.json())["request_id"]
        resp = await super().generate(request)
        base = rid.split(".")[0]
        if base not in self.evicted:
            self.evicted.add(base)
            self.evicting.add(rid)
            self.active[rid]["todo"] = self.active[rid]["todo"][:1]  # one token, then...
        return resp

    def entry(self, e: list) -> list:
        e = super().entry(e)
        return [e[0], e[1], "evicted", *e[3:]] if e[0] in self.evicting and e[2] == "length" else e


async def test_a_migrated_request_keeps_the_cached_tokens_its_first_runner_reported(tok):
    fr = EvictingRunner()
    client, service, servers = await start(tok, [fr])
    try:
        r = await (await client.post("/v1/completions", json=completion(max_tokens=4))).json()
        assert service.metrics.migrations._value.get() == 1
        assert len(fr.seen) == 2 and len(fr.seen[1]["prompt_token_ids"]) == len(PROMPT) + 1  # prompt + its 1st token
        # the second placement found the whole first prompt cached (48 tokens) but the first found none
        assert r["usage"]["completion_tokens"] == 4 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = await (await client.post("/v1/completions", json=completion(list(range(100, 166)), max_tokens=4))).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED  # what the first placement found
    finally:
        await stop(client, servers)


# -- the pool's counters --------------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def wait_for(cond, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_pool_prefix_cache_totals_sum_the_runners_and_never_go_down(tok):
    runners = [CachingFakeRunner("r0"), CachingFakeRunner("r1")]
    client, service, servers = await start(tok, runners)
    try:
        async def totals():
            text = await (await client.get("/metrics")).text()
            return metric(text, "lorafleet_prefix_cache_queries_total"), metric(text, "lorafleet_prefix_cache_hits_total")

        assert await totals() == (0, 0)
        runners[0].queries, runners[0].hits = 1000, 400  # what they reported since they started
        runners[1].queries, runners[1].hits = 500, 100

        async def reached(want):
            async def check():
                return await totals() == want
            return check

        await wait_for(await reached((1500, 500)))
        runners[0].restart()  # its counters begin again at 0 ...
        runners[0].queries, runners[0].hits = 30, 16  # ... and grow
        await wait_for(await reached((1530, 516)))
        runners[1].queries, runners[1].hits = 90, 10  # counters that went down: a restart we did not see
        await wait_for(await reached((1620, 526)))
        runners[1].queries, runners[1].hits = 100, 20
        await wait_for(await reached((1630, 536)))
    finally:
        await stop(client, servers)


# -- failover ------------------------------------------------------------------------------------------------


async def test_failover_from_the_runner_holding_the_prefix_loses_and_repeats_no_token(tok):
    runners = [CachingFakeRunner("r0", step_s=0.02), CachingFakeRunner("r1", step_s=0.02)]
    client, service, servers = await start(tok, runners)
    try:
        body = completion(max_tokens=30)
        want = await (await client.post("/v1/completions", json=body)).json()  # on r1 (a tie goes to the highest id)
        assert len(runners[1].seen) == 1 and not runners[0].seen
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))

        async def streaming_on_r1():  # a few tokens out already
            return len(runners[1].seen) == 2 and any(a["out"] >= 5 for a in runners[1].active.values())

        await wait_for(streaming_on_r1)
        await servers[1].close()  # r1 goes away mid-answer: its stream breaks, its requests move to r0
        got = await (await task).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]  # no token lost or repeated
        assert got["usage"]["completion_tokens"] == 30 and len(runners[0].seen) == 1
        assert len(runners[0].seen[0]["prompt_token_ids"]) >= len(PROMPT) + 5  # resumed with the ids it had
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED  # what r1 reported first
        assert "r1" not in service.cluster.prefix_index.pages  # what r1 held is forgotten ...
        assert service.cluster.prefix_index.pages["r0"]  # ... and r0, which computed it again, remembered
    finally:
        await stop(client, servers[:1])
