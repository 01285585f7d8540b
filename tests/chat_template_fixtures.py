"""Chat templates in the manner of each supported model family, written for these tests, and a
helper that writes a tokenizer directory around one.

Each template uses the jinja features its family's published template relies on: special tokens
as variables, `messages[0]['role']` and slicing, `loop` variables, `namespace`, `raise_exception`,
`strftime_now`, `tojson` (with arguments), string methods, `trim` / `length`, `{% continue %}`,
`{% generation %}`, `tools` and extra variables such as `date_string` and `enable_thinking`.
"""

from __future__ import annotations

import json
from pathlib import Path

# Llama 3.x: a system header with a date, tools as indented JSON (in the first user turn by default).
LLAMA3 = r"""
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if tools_in_user_message is not defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if date_string is not defined %}
    {%- set date_string = "year " + strftime_now("%Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = "" %}
    {%- set turns = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Knowledge cutoff: 2023\nToday: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You may call these functions:\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_text + "<|eot_id|>" }}
{%- for message in turns %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if tools is not none and tools_in_user_message and loop.first and message['role'] == 'user' %}
        {{- "Answer with a function call when one helps:\n" }}
        {%- for t in tools %}
            {{- t | tojson(indent=4) + "\n\n" }}
        {%- endfor %}
    {%- endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral: [INST] turns that must alternate, the system text folded into the last user turn.
MISTRAL = r"""
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{%- set ns = namespace(users=0) %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After an optional system message, turns must go user, assistant, user, ...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- set ns.users = ns.users + 1 %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if ns.users == 0 %}
    {{- raise_exception('There is no user message.') }}
{%- endif %}
"""

# Qwen2 / Qwen2.5: ChatML with a default system turn, tools as JSON lines, tool results grouped.
QWEN25 = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content | tojson }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3: ChatML; thoughts kept only after the last real user query; enable_thinking=false
# answers with an empty thought.
QWEN3 = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user'
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set thought = '' %}
        {%- if message.reasoning_content is string %}
            {%- set thought = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set thought = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and thought %}
            {{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Gemma 3 (text): no system role (its text opens the first user turn), strict alternation,
# "model" for the assistant, content as a string or a list of parts; written without `-` trims.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set preamble = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set preamble = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set preamble = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Roles must alternate between user and assistant.") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (preamble if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'text' -%}
                {{ part['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# Phi-3 / Phi-4-mini: <|role|> turns closed by <|end|>, tools carried by the system message,
# empty turns skipped, the assistant text marked as generated.
PHI = r"""
{%- for message in messages %}
    {%- if message['content'] | length == 0 %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] == 'system' and message['tools'] is defined and message['tools'] is not none %}
        {{- '<|system|>' + message['content'].strip() + '<|tool|>' + message['tools'] + '<|/tool|><|end|>' }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|assistant|>' }}
        {%- generation %}
            {{- message['content'] + '<|end|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|' + message['role'] + '|>' + message['content'].strip() + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""

# name -> (template, special tokens of tokenizer_config.json, where the template is stored)
FAMILIES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "config"),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
                          "unk_token": "<unk>"}, "config"),
    "qwen25": (QWEN25, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "config"),
    "qwen3": (QWEN3, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "file"),
    "gemma3": (GEMMA3, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
               "file"),
    "phi": (PHI, {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, "file"),
}


def write_tokenizer_dir(path: Path, template: str | None, special: dict, where: str = "file") -> Path:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json, maybe chat_template.jinja) that
    both our `Tokenizer` and transformers' `AutoTokenizer` load. `special` maps special token names
    to their text (or an AddedToken object; None: written as null); `where` stores the template in
    the config ("config") or in chat_template.jinja ("file")."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [v["content"] if isinstance(v, dict) else v for v in special.values()]
    tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(texts) if t])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    if template is not None and where == "config":
        cfg["chat_template"] = template
    elif template is not None:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path
