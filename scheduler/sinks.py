"""Where a request's tokens go: straight to its client, on the call stack that read them.

The runner stream reader (`cluster.py`) calls `sink.tokens(req, ids, logprobs, ending)` and `sink.done(req,
reason, error)` synchronously for every request in a runner's step line. One sink serves the
`n` choices of one API call.

- `StreamSink` (SSE): detokenizes and writes the chunk to the client's socket at once — no
  queue, no task switch, no coroutine per token. The HTTP handler does the first write (so
  aiohttp has sent the headers) and then `attach`es the socket; from then on chunks are framed
  (HTTP/1.1 chunked) and written with `transport.write`. A client that stops reading (more than
  `HIGH_WATER` bytes queued) is detached: chunks buffer and the handler writes them with awaits.
- `CollectSink` (non-streaming): text per choice, resolved when every choice has ended.

With log-probabilities asked (`logprobs`: one `openai_api.LogprobsWriter` per choice), each token's entry goes
out with the first chunk that shows text of its token (text held back for a possible stop string holds its
entries back too), the final chunk whatever is left; a stop string ends a choice's entries with the token that
completed it. With `echo` (completions), the prompt's text (and its tokens' entries) comes first.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from lorafleet.scheduler.detokenizer import IncrementalDetokenizer

HIGH_WATER = 1 << 20


class Discard:
    """The sink of a request nobody listens to."""

    def tokens(self, req, ids, logprobs=None, ending=False) -> None:
        pass

    def done(self, req, reason, error) -> None:
        pass


class _Choices:
    """What both sinks keep per choice: its detokenizer, its log-probability writer (`logprobs`, one
    openai_api.LogprobsWriter per choice, or None) and its echoed prompt (`echo`: the prompt text per choice, or
    None), which goes first, with its prompt's log-probabilities when asked, before the choice's first text."""

    def __init__(self, detoks: list[IncrementalDetokenizer], logprobs: list | None, echo: list[str] | None):
        self.detoks, self.logprobs, self.echo = detoks, logprobs, echo
        self.begun = [echo is None] * len(detoks)

    def _begin(self, req) -> str:
        """The echoed prompt of `req`'s choice the first time it is asked for (else "")."""
        i = req.index
        if self.begun[i]:
            return ""
        self.begun[i] = True
        if self.logprobs is not None and req.prompt_ids:
            self.logprobs[i].add_prompt(req.prompt_ids, req.prompt_lps, self.echo[i])
        return self.echo[i]

    def _push(self, req, ids: list[int], logprobs, ending: bool) -> str:
        """The text `ids` add to `req`'s choice (`ending`: the last one ended it, IncrementalDetokenizer.push); with
        log-probabilities, each token's entry goes to its writer unless a stop string ended the choice before that
        token."""
        d = self.detoks[req.index]
        if self.logprobs is None or logprobs is None:
            return d.push(ids, ending)
        writer, out = self.logprobs[req.index], []
        for k, (t, e) in enumerate(zip(ids, logprobs)):
            if d.stopped:
                break
            out.append(d.push([t], ending and k == len(ids) - 1))
            writer.add([t], [e], [d.last_new])  # (the text it adds, for completions' text_offset)
        return "".join(out)


class CollectSink(_Choices):
    def __init__(self, detoks: list[IncrementalDetokenizer], on_stop: Callable, logprobs: list | None = None,
                 echo: list[str] | None = None):
        super().__init__(detoks, logprobs, echo)
        self.on_stop = on_stop
        self.parts: list[list[str]] = [[] for _ in detoks]
        self.ends: list[tuple | None] = [None] * len(detoks)
        self.left = len(detoks)
        self.finished = asyncio.get_running_loop().create_future()

    def tokens(self, req, ids, logprobs=None, ending=False) -> None:
        d = self.detoks[req.index]
        text = self._begin(req) + self._push(req, ids, logprobs, ending)
        if text:
            self.parts[req.index].append(text)
        if d.stopped:
            self.on_stop(req)

    def done(self, req, reason, error) -> None:
        i = req.index
        if self.ends[i] is not None:
            return
        if reason in ("stop", "length"):
            tail = self._begin(req) + self.detoks[i].flush()
            if tail:
                self.parts[i].append(tail)
        self.ends[i] = (reason, error)
        self.left -= 1
        if not self.left and not self.finished.done():
            self.finished.set_result(None)


class StreamSink(_Choices):
    """`failure_body(req, reason, error)` gives the OpenAI error object of a choice that ended
    without stop/length; `first_failure` is (req, reason, error) when such an end came before any
    chunk (the handler then answers with a JSON error instead of starting the stream)."""

    def __init__(self, detoks: list[IncrementalDetokenizer], enc, chat: bool, on_stop: Callable, on_gone: Callable,
                 failure_body: Callable | None = None, logprobs: list | None = None, echo: list[str] | None = None):
        super().__init__(detoks, logprobs, echo)
        self.enc, self.chat = enc, chat
        self.on_stop, self.on_gone = on_stop, on_gone
        self.failure_body = failure_body
        self.first_failure: tuple | None = None
        self.produced = False
        self.left = len(detoks)
        self.ended = [False] * len(detoks)
        self.buf: list[bytes] = []
        self.transport = None
        self.chunked = True
        self.gone = False
        self._wake: asyncio.Future | None = None

    # -- the handler's side ---------------------------------------------------------------------
    def attach(self, transport, chunked: bool) -> None:
        """Write future chunks straight to `transport` (after the handler's first awaited write)."""
        if not self.buf and transport is not None and not transport.is_closing():
            self.transport, self.chunked = transport, chunked

    def take(self) -> bytes:
        data = b"".join(self.buf)
        self.buf.clear()
        return data

    @property
    def finished(self) -> bool:
        return self.left == 0 or self.gone

    async def wait(self) -> None:
        """Until there is something for the handler to write, or the call has ended."""
        if not self.buf and not self.finished:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake

    def _notify(self) -> None:
        w = self._wake
        if w is not None:
            self._wake = None
            if not w.done():
                w.set_result(None)

    # -- the stream reader's side ---------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self.produced = True
        t = self.transport
        if t is None:
            self.buf.append(data)
            self._notify()
            return
        if t.is_closing():
            self._lost()
            return
        t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if t.get_write_buffer_size() > HIGH_WATER:
            self.transport = None  # a slow reader: the handler takes over, with awaits
            self._notify()

    def _lost(self) -> None:
        if not self.gone:
            self.gone = True
            self.transport = None
            self.on_gone()
            self._notify()

    def _take(self, index: int) -> dict | None:
        return self.logprobs[index].take() if self.logprobs is not None else None

    def tokens(self, req, ids, logprobs=None, ending=False) -> None:
        d = self.detoks[req.index]
        text = self._begin(req) + self._push(req, ids, logprobs, ending)
        if text and not self.gone:
            self._send(self.enc.text(req.index, text, self._take(req.index)))
        if d.stopped:
            self.on_stop(req)

    def done(self, req, reason, error) -> None:
        i = req.index
        if self.ended[i]:
            return
        self.ended[i] = True
        if not self.gone:
            if reason in ("stop", "length"):
                tail = self._begin(req) + self.detoks[i].flush()
                left = self._take(i)
                if tail:
                    self._send(self.enc.text(i, tail, left) + self.enc.chunk(i, None if self.chat else "", reason))
                else:
                    self._send(self.enc.chunk(i, None if self.chat else "", reason, logprobs=left))
            else:
                if not self.produced and self.first_failure is None:
                    self.first_failure = (req, reason, error)
                body = self.failure_body(req, reason, error) if self.failure_body else {
                    "message": f"generation failed: {error or reason}", "type": "server_error", "param": None,
                    "code": "generation_failed"}
                self._send(self.enc.event({"error": body}))
        self.left -= 1
        if not self.left:
            self._notify()
