"""The base model's tokenizer and chat template, without torch or transformers.

Reads `tokenizer.json` (the `tokenizers` library) and `tokenizer_config.json` /
`chat_template.jinja` from a model directory, and renders chat templates in a sandboxed jinja2
environment set up as Hugging Face's `apply_chat_template` sets up its own, so a template
renders to the same text here as there:

- `tojson` is JSON as the templates expect it: no HTML escaping, keys in their given order,
  non-ASCII kept, `indent` / `separators` / `sort_keys` / `ensure_ascii` accepted (jinja's own
  filter escapes `<>&'`, sorts keys and writes non-ASCII as `\\uXXXX`);
- `{% break %}` / `{% continue %}` and the `{% generation %}` block (marks assistant text for
  training masks; here it renders its body) compile;
- globals `raise_exception(message)` and `strftime_now(format)`; namespaces refuse
  underscore-prefixed attributes;
- variables: `messages` (keys whose value is None dropped), `add_generation_prompt`, `tools`
  and `documents` (None unless given), every special token the tokenizer config names
  (`bos_token`, `eos_token`, `unk_token`, ...) as its text, then the caller's extra variables
  (`enable_thinking`, `date_string`, ...), which may not replace any of those.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """`namespace(...)` whose attributes may not start with an underscore."""

    def __init__(*args, **kwargs):  # jinja's own signature: `namespace(self=...)` stays possible
        Namespace.__init__(*args, **kwargs)
        for name in dict(*args[1:], **kwargs):
            _Namespace._check(name)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()

#: Names a request's extra template variables may not take: what the renderer sets itself (and `self`, the name of
#: jinja's Template.render's own first parameter: as a keyword it cannot reach the template at all).
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "self",
                                    *SPECIAL_TOKEN_NAMES, *_ENV.globals})


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{d} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path} cannot be read by the tokenizers library ({exc})") from None
        cfg_path = d / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{cfg_path} is not readable JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path} must hold a JSON object, found {type(cfg).__name__}")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if isinstance(text := _token_text(cfg.get(name)), str)}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        }
        self._template = None
        self._template_problem: str | None = None
        self._max_token_chars: int | None = None
        self._pieces: list[bytes] | None = None
        self._special_pieces: list[bytes] | None = None  # byte_pieces(skip_special_tokens=False)
        if template:
            try:
                self._template = _ENV.from_string(template)
            except TemplateError as exc:  # chat requests are refused with this; completions still work
                self._template_problem = f"this model's chat template does not compile: {exc}"
                log.error("%s", self._template_problem)

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """For byte-level BPE tokenizers (GPT-2 style `ByteLevel` decoder): the bytes each id decodes
        to (b"" for special ids, as `decode(skip_special_tokens=True)` drops them; with False their text, as
        `decode(skip_special_tokens=False)` spells them), so incremental detokenization is a table lookup plus an
        incremental UTF-8 decoder. None for other decoders."""
        if not skip_special_tokens:
            pieces = self.byte_pieces()
            if pieces is None:
                return None
            if self._special_pieces is None:  # (each special token as the library's own decode spells it)
                self._special_pieces = [self._tok.decode([i], skip_special_tokens=False).encode()
                                        if i in self.special_ids else b for i, b in enumerate(pieces)]
            return self._special_pieces
        if self._pieces is not None:
            return self._pieces or None
        self._pieces = []
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        pieces = []
        for i in range(self.vocab_size):
            if i in self.special_ids:
                pieces.append(b"")
            elif i in added:
                pieces.append(added[i].encode())
            else:
                tok = self._tok.id_to_token(i) or ""
                try:
                    pieces.append(bytes(to_byte[c] for c in tok))
                except KeyError:
                    pieces.append(tok.encode())
        self._pieces = pieces
        return pieces

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Like `encode` for several texts; releases the GIL while it works (safe in a thread)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters (an upper bound of what one token covers)."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def text_offsets(self, ids: list[int], text: str) -> list[int] | None:
        """Where each of a prompt's tokens starts in `text`, by the tokenizer's own offsets, when `text` encodes to
        `ids` (a prompt sent as text; a token it added, such as BOS, starts at 0); else None."""
        enc = self._tok.encode(text)
        return [start for start, _ in enc.offsets] if enc.ids == list(ids) else None

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` stands for in generated text, a special token spelt out (what log-probabilities show
        for each token: with byte-level BPE a token may hold part of a UTF-8 character)."""
        pieces = self.byte_pieces()
        if pieces is not None and 0 <= i < len(pieces) and i not in self.special_ids:
            return pieces[i]
        return self._tok.decode([i], skip_special_tokens=False).encode()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    documents: list[dict] | None = None) -> str:
        """The prompt text of `messages`, as `apply_chat_template(messages, tools=tools,
        documents=documents, add_generation_prompt=..., tokenize=False, **template_kwargs)`
        renders it. ChatTemplateError when the template refuses the input (its
        `raise_exception` message is kept) or fails on it."""
        if self._template is None:
            raise ChatTemplateError(self._template_problem or "this model has no chat template; use /v1/completions")
        extra = dict(template_kwargs or {})
        if clash := sorted(RESERVED_TEMPLATE_VARS.intersection(extra)):
            raise ChatTemplateError(f"template variables {', '.join(clash)} are set by the server")
        try:
            return self._template.render(
                messages=[{k: v for k, v in dict(m).items() if v is not None} for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **extra,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None
        except Exception as exc:  # the template failed on this input: still the client's input, so a 400
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, template_kwargs),
                           add_special_tokens=False)
