"""`lorafleet serve` end to end with the official openai client, on the SmolLM2 demo."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.scheduler.tokenizer import Tokenizer
from serve_helpers import Served

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Give me a tip for learning to cook.",
             "Tell me about the moon."]
ADAPTERS = [None, "pirate", "shouty", "terse"]


@pytest.fixture(scope="module")
def served(demo_model, demo_adapters):
    s = Served(demo_model, demo_adapters)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_name(served):
    return json.loads(urllib.request.urlopen(f"{served.url}/v1/models").read())["data"][0]["id"]


def openai_client(served, cls="OpenAI"):
    import openai

    return getattr(openai, cls)(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_list(served, base_name):
    models = openai_client(served).models.list()
    ids = {m.id: getattr(m, "parent", None) for m in models.data}
    assert base_name == "SmolLM2-135M-Instruct"
    assert ids == {base_name: None, "pirate": base_name, "shouty": base_name, "terse": base_name}


def test_openai_client_all_modes_equal_generate(served, base_name, demo_model, demo_adapters, tmp_path):
    client = openai_client(served, "AsyncOpenAI")
    tok = Tokenizer(demo_model)
    cases = []  # (kind, stream, model, question)
    for i, name in enumerate(ADAPTERS):
        for kind in ("chat", "completion"):
            for stream in (False, True):
                cases.append((kind, stream, name or base_name, QUESTIONS[(i + len(cases)) % len(QUESTIONS)]))

    async def one(kind, stream, model, q):
        if kind == "chat":
            kw = dict(model=model, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0)
            if stream:
                parts = []
                async for ch in await client.chat.completions.create(stream=True, **kw):
                    if ch.choices and ch.choices[0].delta.content:
                        parts.append(ch.choices[0].delta.content)
                return "".join(parts)
            return (await client.chat.completions.create(**kw)).choices[0].message.content
        kw = dict(model=model, prompt=q, max_tokens=24, temperature=0)
        if stream:
            parts = []
            async for ch in await client.completions.create(stream=True, **kw):
                parts.append(ch.choices[0].text)
            return "".join(parts)
        return (await client.completions.create(**kw)).choices[0].text

    async def all_cases():
        return await asyncio.gather(*(one(*c) for c in cases))

    got = asyncio.run(all_cases())

    # The same requests through `lorafleet generate` (one offline batch).
    inp = tmp_path / "in.jsonl"
    with inp.open("w") as f:
        for k, (kind, _, model, q) in enumerate(cases):
            ids = tok.encode_chat([{"role": "user", "content": q}]) if kind == "chat" else tok.encode(q)
            f.write(json.dumps({"id": str(k), "adapter": None if model == base_name else model,
                                "prompt_token_ids": ids, "max_tokens": 24}) + "\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "lorafleet", "generate", "--model", str(demo_model), "--adapters",
                        str(demo_adapters), "--input", str(inp), "--output", str(out), "--no-progress",
                        "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    want = [json.loads(x)["text"] for x in out.read_text().splitlines()]
    assert got == want
    # adapters visibly change the answer to the same chat question
    texts = {c[2]: g for c, g in zip(cases, got) if c[0] == "chat" and not c[1]}
    assert len(set(texts.values())) == len(texts)
    assert "Arr" in texts["pirate"]


def test_64_concurrent_streams_match_sequential(served, base_name, demo_model, demo_adapters):
    tok = Tokenizer(demo_model)
    client = openai_client(served, "AsyncOpenAI")
    reqs = [(ADAPTERS[i % 4], f"Q{i}: " + QUESTIONS[i % len(QUESTIONS)]) for i in range(64)]

    async def one(name, q):
        parts = []
        async for ch in await client.completions.create(model=name or base_name, prompt=q, max_tokens=12,
                                                        temperature=0, stream=True):
            parts.append(ch.choices[0].text)
        return "".join(parts)

    async def run_all():
        return await asyncio.gather(*(one(n, q) for n, q in reqs))

    got = asyncio.run(run_all())
    seqs = [Sequence(str(i), tok.encode(q), SamplingParams(max_tokens=12),
                     AdapterRef(n, str(demo_adapters / n)) if n else None) for i, (n, q) in enumerate(reqs)]
    out = one_at_a_time(demo_model, [seqs[0::2], seqs[1::2]])
    want = [tok.decode(out[str(i)].output_ids) for i in range(len(reqs))]
    assert got == want


def one_at_a_time(model, parts: list[list[Sequence]]) -> dict:
    """Each part's requests on an engine of its own that takes strictly one request at a time. The engines run
    side by side, one torch thread each: a batch of one uses one core, and the machine has more."""
    import torch

    def run(part):
        return Engine(str(model), EngineConfig(max_batch_size=1, kv_cache_gb=0.1)).run_to_completion(part)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(len(parts)) as pool:
            return {rid: seq for out in pool.map(run, parts) for rid, seq in out.items()}
    finally:
        torch.set_num_threads(threads)


def test_client_disconnect_frees_pages_within_a_second(served, base_name):
    import httpx

    runner = served.admin_state()["runners"][0]["url"]
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{served.url}/v1/completions",
                      json={"model": base_name, "prompt": "Count to a thousand:", "max_tokens": 2000,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break
            st = served.runner_state(runner)
            assert st["batch_size"] == 1 and st["free_kv_tokens"] < st["total_kv_tokens"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        st = served.runner_state(runner)
        if st["batch_size"] == 0 and st["free_kv_tokens"] == st["total_kv_tokens"]:
            break
        time.sleep(0.05)
    assert st["batch_size"] == 0 and st["free_kv_tokens"] == st["total_kv_tokens"], st


def test_runners_need_the_credential_serve_made(served):
    import urllib.error

    runner = served.admin_state()["runners"][0]["url"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{runner}/state", timeout=5)
    assert e.value.code == 401
    assert urllib.request.urlopen(f"{runner}/healthz", timeout=5).status == 200
    assert served.runner_state(runner)["ready"] is True


def test_errors_through_the_real_server(served, base_name):
    import openai

    client = openai_client(served)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base_name, prompt="x", temperature=5)
    assert e.value.body["param"] == "temperature"


def test_graceful_shutdown_finishes_in_flight_and_leaves_no_process(demo_model, demo_adapters):
    s = Served(demo_model, demo_adapters, "--grace-seconds", "30")
    s.wait_ready()
    kids = s.children()
    assert kids, "serve should have runner children"
    cores = [c for k in kids for c in s.children(k)]
    assert len(cores) == len(kids), "every runner front has its engine core process"
    kids += cores
    import httpx

    import threading

    result = {}
    first = threading.Event()

    def stream():
        lines = []
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", f"{s.url}/v1/completions",
                          json={"model": "pirate", "prompt": "Tell me a story.", "max_tokens": 40, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as resp:
                for ln in resp.iter_lines():
                    if ln.startswith("data: "):
                        lines.append(ln)
                        first.set()
        result["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60), "no token arrived"  # the request is in flight
    code = s.stop(timeout=90)
    t.join(timeout=60)
    assert code == 0, s.proc.stdout.read()[-2000:]
    assert result["lines"][-1] == "data: [DONE]"
    finals = [json.loads(ln[6:]) for ln in result["lines"][:-1]]
    assert finals[-1].get("choices", [{}])[0].get("finish_reason") == "length", (finals[-1], s.proc.stdout.read()[-6000:])
    for pid in kids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_chat_logprobs_through_the_openai_client_equal_hf_peft(served, demo_model, demo_adapters):
    """The served adapter's greedy tokens and their log-probabilities (with 3 alternatives each) against HF + PEFT's
    log-softmax in fp32, teacher-forced on the same tokens."""
    from reference import HFReference

    tok = Tokenizer(demo_model)
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    out = openai_client(served).chat.completions.create(model="pirate", messages=msgs, max_tokens=12, temperature=0,
                                                        logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    prompt = tok.encode_chat(msgs)
    want_ids = HFReference(demo_model, {"pirate": demo_adapters / "pirate"}).greedy(prompt, "pirate", 12, eos=2)
    assert [bytes(c.bytes) for c in content] == [tok.token_bytes(i) for i in want_ids]
    ref = HFReference(demo_model, {"pirate": demo_adapters / "pirate"})
    logp = ref.logits(prompt + want_ids, "pirate").log_softmax(-1)[len(prompt) - 1: -1]
    for pos, (i, c) in enumerate(zip(want_ids, content)):
        assert c.logprob == pytest.approx(float(logp[pos, i]), abs=2e-3)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        top = logp[pos].topk(3)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)


def test_logit_bias_and_min_tokens_through_the_openai_client(served, base_name, demo_model):
    """A bias of +100 on one token makes greedy decoding repeat it; min_tokens keeps EOS away until then."""
    tok = Tokenizer(demo_model)
    client = openai_client(served)
    word = tok.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(model=base_name, prompt="Fruit:", max_tokens=5, temperature=0,
                                    logit_bias={str(word): 100})
    assert out.choices[0].text == tok.decode([word] * 5)
    eos = tok.eos_token_id
    out = client.completions.create(model=base_name, prompt="Hi", max_tokens=6, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "stop"  # 4 tokens, then EOS


def test_echo_scores_a_prompt_as_hf_peft_does(served, demo_model, demo_adapters):
    """lm-evaluation-harness's loglikelihood call (echo, logprobs, max_tokens 0) on an adapter: each prompt token's
    log-probability equals HF + PEFT's in fp32, and the greedy flag it derives (is each token the top one?) too."""
    from reference import HFReference

    tok = Tokenizer(demo_model)
    ids = tok.encode("The capital of France is Paris, and the capital of Spain is Madrid.")
    out = openai_client(served).completions.create(model="terse", prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                                   temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == tok.decode(ids) and len(lp.token_logprobs) == len(ids)
    want = HFReference(demo_model, {"terse": demo_adapters / "terse"}).logits(ids, "terse").log_softmax(-1)
    assert lp.token_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(want[p - 1, ids[p]]), abs=2e-3), p
        top_id = int(want[p - 1].argmax())
        assert list(lp.top_logprobs[p]) == [tok.token_bytes(top_id).decode("utf-8", "replace")]
