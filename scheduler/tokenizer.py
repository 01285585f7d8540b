"""The base model's tokenizer and chat template, without torch or transformers.

Reads `tokenizer.json` (the `tokenizers` library) and `tokenizer_config.json` /
`chat_template.jinja` from a model directory; renders chat templates with a sandboxed
jinja2 environment the way Hugging Face does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _raise(message: str):
    raise TemplateError(message)


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
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        }
        self._template = None
        self._max_token_chars: int | None = None
        self._pieces: list[bytes] | None = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    def byte_pieces(self) -> list[bytes] | None:
        """For byte-level BPE tokenizers (GPT-2 style `ByteLevel` decoder): the bytes each id decodes
        to (b"" for special ids, as `decode(skip_special_tokens=True)` drops them), so incremental
        detokenization is a table lookup plus an incremental UTF-8 decoder. None for other decoders."""
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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
