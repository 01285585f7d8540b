"""The scheduler's chat template renderer writes, for every family's kind of template, exactly
the text transformers' `apply_chat_template(..., tokenize=False)` writes, and refuses what
transformers refuses with a ChatTemplateError carrying the template's own message."""

from __future__ import annotations

import re

import jinja2
import pytest
from chat_template_fixtures import FAMILIES, write_tokenizer_dir

from lorafleet.scheduler.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# Conversations as the OpenAI API hands them to the renderer: role and string content only.
CONVERSATIONS = {
    "one_user_turn": [user("Hello there")],
    "system_and_user": [SYSTEM, user("What is 2 + 2?")],
    "multi_turn": [SYSTEM, user("Name a colour."), assistant("Blue."), user("Another one?")],
    "multi_turn_without_system": [user("a"), assistant("b"), user("c"), assistant("d"), user("e")],
    "markup_unicode_and_spaces": [
        {"role": "system", "content": "  Be <brief> & 'exact', \"please\".  \n"},
        user("Ça coûte 5 € — <b>vraiment</b>?\n\n "), assistant(" Oui. "), user("日本語で\tどうぞ")],
    "empty_assistant_turn": [user("first"), assistant(""), user("second")],
    "thought_in_history": [user("q1"), assistant("<think>\nweighing it\n</think>\n\nfour"), user("q2")],
    "tool_results": [user("weather?"), assistant(""), {"role": "tool", "content": "{\"temp\": 21, \"unit\": \"°C\"}"},
                     {"role": "tool", "content": "<ok/>"}, user("thanks")],
    "system_not_first": [user("hi"), SYSTEM, user("again")],
    "two_users_in_a_row": [user("one"), user("two")],
    "assistant_last": [SYSTEM, user("start"), assistant("Once upon")],
}

# What a direct caller of the renderer may pass and the API does not produce.
DIRECT_CONVERSATIONS = {
    "content_parts": [{"role": "system", "content": [{"type": "text", "text": "Use parts."}]},
                      {"role": "user", "content": [{"type": "text", "text": " part one "},
                                                   {"type": "text", "text": "part two"}]}],
    "reasoning_field": [user("q"), {"role": "assistant", "content": "a", "reasoning_content": "because"}],
    "none_valued_keys": [user("q"), {"role": "assistant", "content": "a", "reasoning_content": None}, user("r")],
    "phi_system_tools": [{"role": "system", "content": " Use tools. ", "tools": "[{\"name\": \"lookup\"}]"},
                         user("find x")],
}

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Finds <tags> & 'quotes' in naïve text",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]

# Per family: (tools, extra template variables) to render each conversation with.
VARIANTS = {
    "llama3": [(None, {}), (None, {"date_string": "26 Jan 2031"}), (TOOLS, {"date_string": "1 May 2030"}),
               (TOOLS, {"tools_in_user_message": False, "date_string": "1 May 2030"})],
    "mistral": [(None, {})],
    "qwen25": [(None, {}), (TOOLS, {})],
    "qwen3": [(None, {}), (None, {"enable_thinking": False}), (None, {"enable_thinking": True})],
    "gemma3": [(None, {})],
    "phi": [(None, {})],
}


def _pair(root, name, template, special, where):
    d = write_tokenizer_dir(root / name, template, special, where)
    return Tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-templates")
    return {name: _pair(root, name, *spec) for name, spec in FAMILIES.items()}


def assert_same(ours: Tokenizer, hf, messages, add_generation_prompt=True, tools=None, **kwargs) -> str | None:
    """Our rendering equals transformers'; where transformers refuses, we refuse (with the template's
    message when it raised one).
    Returns the text (None when refused)."""
    try:
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- whatever transformers raises, we must refuse too
        with pytest.raises(ChatTemplateError) as refused:
            ours.render_chat(messages, add_generation_prompt, kwargs, tools=tools)
        if isinstance(exc, jinja2.TemplateError) and not isinstance(exc, jinja2.exceptions.SecurityError):
            assert str(exc) in str(refused.value)  # raise_exception's text, or jinja's own
        return None
    got = ours.render_chat(messages, add_generation_prompt, kwargs, tools=tools)
    assert got == want
    return got


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_each_family_template_renders_api_conversations_as_transformers(families, family, conversation):
    ours, hf = families[family]
    for tools, kwargs in VARIANTS[family]:
        for gen in (True, False):
            assert_same(ours, hf, CONVERSATIONS[conversation], gen, tools, **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_template_renders_direct_input_as_transformers(families, family):
    ours, hf = families[family]
    for messages in DIRECT_CONVERSATIONS.values():
        for tools, kwargs in VARIANTS[family]:
            assert_same(ours, hf, messages, True, tools, **kwargs)


def test_the_comparison_renders_most_cases_and_the_strict_families_refuse(families):
    """Guard on the comparison itself: it compares real text, and the refusals are the templates'."""
    rendered = {name: 0 for name in FAMILIES}
    for name, (ours, hf) in families.items():
        for messages in CONVERSATIONS.values():
            rendered[name] += assert_same(ours, hf, messages) is not None
    assert min(rendered.values()) >= 7, rendered
    ours, hf = families["mistral"]
    with pytest.raises(ChatTemplateError, match="turns must go user, assistant"):
        ours.render_chat(CONVERSATIONS["two_users_in_a_row"])
    with pytest.raises(ChatTemplateError, match="Roles must alternate"):
        families["gemma3"][0].render_chat(CONVERSATIONS["two_users_in_a_row"])


def test_family_specific_variables_change_the_prompt(families):
    qwen3 = families["qwen3"][0]
    plain = qwen3.render_chat([user("hi")])
    assert plain.endswith("<|im_start|>assistant\n")
    no_think = qwen3.render_chat([user("hi")], template_kwargs={"enable_thinking": False})
    assert no_think == plain + "<think>\n\n</think>\n\n"
    llama = families["llama3"][0]
    assert "Today: 26 Jan 2031\n" in llama.render_chat([user("hi")], template_kwargs={"date_string": "26 Jan 2031"})
    with_tools = llama.render_chat([user("hi")], tools=TOOLS, template_kwargs={"tools_in_user_message": False})
    assert '"description": "Finds <tags> & \'quotes\' in naïve text"' in with_tools
    assert with_tools.index('"type": "function"') < with_tools.index('"function": {')  # keys keep their order


def test_tojson_writes_json_as_transformers_does(tmp_path):
    probe = ("{{ x | tojson }}\n{{ x | tojson(indent=2) }}\n{{ x | tojson(sort_keys=true, separators=[',', ':']) }}\n"
             "{{ x | tojson(ensure_ascii=true) }}\n{{ messages[0].content | tojson }}")
    ours, hf = _pair(tmp_path, "probe", probe, {"eos_token": "</s>"}, "file")
    x = {"b": "<é> & 'q'", "a": [1, 2.5, None, True, {"z": "\u2028"}]}
    got = assert_same(ours, hf, [user("<b>\"hé\"</b>")], x=x)
    first = got.split("\n")[0]
    assert first == '{"b": "<é> & \'q\'", "a": [1, 2.5, null, true, {"z": "\u2028"}]}'
    assert got.split("\n")[-1] == '"<b>\\"hé\\"</b>"'


def test_special_tokens_tools_documents_and_none_values_are_as_in_transformers(tmp_path):
    probe = ("{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|"
             "{{ tools }}|{{ documents }}|{{ messages | length }}|{{ messages[1].content is defined }}")
    ours, hf = _pair(tmp_path, "probe", probe, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<pad>"},
                     "config")
    assert assert_same(ours, hf, [user("x"), {"role": "assistant", "content": None}]) == \
        "False|<|im_end|>|<pad>|False|None|None|2|False"


def test_loop_controls_generation_blocks_and_strftime_compile(tmp_path):
    probe = ("{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index > 3 %}"
             "{% break %}{% endif %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
             "{{ strftime_now('%Y') | length }}")
    ours, hf = _pair(tmp_path, "probe", probe, {"eos_token": "</s>"}, "file")
    assert assert_same(ours, hf, [user(c) for c in "abcde"]) == "[a][c]4"


def test_namespaces_refuse_underscore_attributes_as_transformers_does(tmp_path):
    probe = "{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}{{ ns.a }}"
    ours, hf = _pair(tmp_path, "probe", probe, {"eos_token": "</s>"}, "file")
    assert assert_same(ours, hf, [user("x")]) is None


def test_any_failure_while_rendering_is_a_chat_template_error(tmp_path):
    ours = Tokenizer(write_tokenizer_dir(tmp_path / "m", "{{ 100 // divisor }}{{ messages[5].content.upper() }}",
                                         {"eos_token": "</s>"}))
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        ours.render_chat([user("x")], template_kwargs={"divisor": 0})
    with pytest.raises(ChatTemplateError, match=re.escape("chat template error:")):
        ours.render_chat([user("x")], template_kwargs={"divisor": 1})


def test_extra_variables_may_not_replace_what_the_renderer_sets(families):
    ours = families["qwen3"][0]
    for name in ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "tools",
                 "raise_exception", "namespace"):
        with pytest.raises(ChatTemplateError, match=name):
            ours.render_chat([user("x")], template_kwargs={name: "x"})


def test_a_template_that_does_not_compile_refuses_chat_but_still_tokenizes(tmp_path):
    ours = Tokenizer(write_tokenizer_dir(tmp_path / "m", "{% for m in messages %}{{ m.content }}",
                                         {"eos_token": "</s>"}))
    assert ours.encode("hello world") == [1, 2]
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.render_chat([user("hello")])


def test_the_demo_models_own_template_renders_as_transformers(demo_model, tok):
    hf = transformers.AutoTokenizer.from_pretrained(str(demo_model))
    for messages in CONVERSATIONS.values():
        for gen in (True, False):
            assert_same(tok, hf, messages, gen)
