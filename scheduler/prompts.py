"""Prompts to token ids, off the event loop and bounded.

Tokenization runs in a small thread pool through `Tokenizer.encode_batch`, which releases
the GIL, so a multi-megabyte prompt never stalls other requests or `/healthz`. Before any
work, a text that cannot fit the context whatever it tokenizes to is refused at once: no
token covers more than `max_token_chars` characters (the longest vocabulary entry, doubled
for normalization), so `len(text) / max_token_chars` is a lower bound of its token count.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from lorafleet.scheduler.openai_api import bad, context_exceeded
from lorafleet.scheduler.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, workers: int = 2):
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * 2 * max(tokenizer.max_token_chars(), 1)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _check_chars(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_chars:
            raise context_exceeded(param, f"the prompt ({n_chars} characters) is longer than this model's maximum "
                                          f"context length of {self.max_model_len} tokens")

    def _encode(self, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
        try:
            return self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        except Exception as exc:  # the tokenizer refused the text: client input, so a 400
            log.warning("tokenizer refused a %s: %s", param, exc)
            raise bad(param, "the text could not be tokenized") from None

    def _chat(self, messages: list[dict], template_kwargs: dict | None, add_generation_prompt: bool = True) -> list[int]:
        try:
            text = self.tok.render_chat(messages, add_generation_prompt, template_kwargs=template_kwargs)
        except ChatTemplateError as exc:
            raise bad("messages", str(exc)) from None
        self._check_chars(len(text), "messages")
        return self._encode([text], False, "messages")[0]

    async def chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """Render the chat template and tokenize, in the pool; ApiError(400) on bad input.

        `template_kwargs` are extra template variables; by default those `messages` carries
        (`ChatMessages.template_kwargs`, from the request's `chat_template_kwargs`)."""
        if template_kwargs is None:
            template_kwargs = getattr(messages, "template_kwargs", None)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._chat, messages, template_kwargs)

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """A chat's token ids as `chat` gives them, with or without the generation prompt (`/v1/tokenize`)."""
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self._chat, messages, getattr(messages, "template_kwargs", None), add_generation_prompt)

    async def text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """One text's token ids (`/v1/tokenize`), in the pool."""
        self._check_chars(len(text), "prompt")
        return (await asyncio.get_running_loop().run_in_executor(
            self.pool, self._encode, [text], add_special_tokens, "prompt"))[0]

    async def prompts(self, items: list[str | list[int]]) -> list[list[int]]:
        """Completions prompts (texts or token id lists) to token ids; texts tokenized in the pool."""
        texts = [x for x in items if isinstance(x, str)]
        for t in texts:
            self._check_chars(len(t), "prompt")
        if not texts:
            return [list(x) for x in items]
        encoded = iter(await asyncio.get_running_loop().run_in_executor(
            self.pool, self._encode, texts, True, "prompt"))
        return [next(encoded) if isinstance(x, str) else list(x) for x in items]
