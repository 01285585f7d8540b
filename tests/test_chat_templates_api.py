"""`/v1/chat/completions` with the model's chat template: `chat_template_kwargs` reach the template,
bad ones are refused with a 400 naming them, and a template that refuses the conversation (its
`raise_exception`) or fails on it is a 400 carrying the template's message, never a 5xx."""

from __future__ import annotations

import json
import shutil

import pytest
from api_helpers import start, stop
from chat_template_fixtures import QWEN3
from fake_runner import FakeRunner

from lorafleet.scheduler.tokenizer import Tokenizer

CHECKED = r"""
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('A system message may only come first.') }}
    {%- endif %}
{%- endfor %}
{%- if context is defined %}
    {{- '<|im_start|>system\n' + context | tojson + '<|im_end|>\n' }}
{%- endif %}
{%- if divisor is defined %}
    {{- (100 // divisor) | string }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory, demo_model) -> Tokenizer:
    """The demo model's tokenizer with a Qwen3-style template that also checks the system turn's place
    and reads two extra variables."""
    d = tmp_path_factory.mktemp("api-template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(CHECKED + QWEN3)
    return Tokenizer(d)


@pytest.fixture
async def api(chat_tok):
    fr = FakeRunner()
    client, service, servers = await start(chat_tok, [fr])
    yield client, fr
    await stop(client, servers)


HI = [{"role": "user", "content": "Hi"}]


async def _prompt(client, fr, tok, **extra) -> str:
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": HI, "max_tokens": 2, **extra})
    assert r.status == 200, await r.text()
    return tok.decode(fr.seen[-1]["prompt_token_ids"], skip_special_tokens=False)


async def test_chat_template_kwargs_reach_the_template(api, chat_tok):
    client, fr = api
    plain = await _prompt(client, fr, chat_tok)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert await _prompt(client, fr, chat_tok, chat_template_kwargs=None) == plain
    assert await _prompt(client, fr, chat_tok, chat_template_kwargs={}) == plain
    no_think = await _prompt(client, fr, chat_tok, chat_template_kwargs={"enable_thinking": False})
    assert no_think == plain + "<think>\n\n</think>\n\n"
    assert await _prompt(client, fr, chat_tok, chat_template_kwargs={"enable_thinking": True}) == plain
    ctx = await _prompt(client, fr, chat_tok, chat_template_kwargs={"context": {"city": "Zürich", "tags": ["<a>"]}})
    assert ctx == '<|im_start|>system\n{"city": "Zürich", "tags": ["<a>"]}<|im_end|>\n' + plain


async def test_chat_template_kwargs_stream_too(api, chat_tok):
    client, fr = api
    body = {"model": "base", "messages": HI, "max_tokens": 2, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200 and (await r.text()).rstrip().endswith("data: [DONE]")
    assert chat_tok.decode(fr.seen[-1]["prompt_token_ids"], skip_special_tokens=False).endswith("</think>\n\n")


BAD_KWARGS = [
    [], "enable_thinking=false", 5, True,
    {"messages": []}, {"add_generation_prompt": False}, {"bos_token": "<s>"}, {"eos_token": ""},
    {"tools": []}, {"documents": []}, {"raise_exception": 1}, {"strftime_now": "2020"},
    {"self": 1},  # (render's own parameter: a TypeError inside the renderer, reported against messages)
]


@pytest.mark.parametrize("kwargs", BAD_KWARGS, ids=[json.dumps(k) for k in BAD_KWARGS])
async def test_bad_chat_template_kwargs_are_a_400_naming_them(api, kwargs):
    client, fr = api
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": HI,
                                                         "chat_template_kwargs": kwargs})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "chat_template_kwargs", body
    assert fr.seen == []


async def test_non_finite_numbers_in_chat_template_kwargs_are_refused(api):
    client, fr = api
    raw = '{"model": "base", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"t": [NaN]}}'
    r = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "chat_template_kwargs" and "NaN" in body["error"]["message"]
    assert fr.seen == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_template_refusal_is_a_400_with_the_templates_message(api, stream):
    client, fr = api
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": messages, "stream": stream})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "chat template error: A system message may only come first."
    assert fr.seen == []


async def test_a_template_failing_on_a_variable_is_a_400(api, chat_tok):
    client, fr = api
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": HI,
                                                         "chat_template_kwargs": {"divisor": 0}})
    body = await r.json()
    assert r.status == 400 and "ZeroDivisionError" in body["error"]["message"], body
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": HI,
                                                         "chat_template_kwargs": {"divisor": "two"}})
    assert r.status == 400 and "TypeError" in (await r.json())["error"]["message"]
    assert fr.seen == []
    assert await _prompt(client, fr, chat_tok, chat_template_kwargs={"divisor": 4}) == \
        "25<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
