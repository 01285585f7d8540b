"""Incremental detokenization with stop strings, correct across multi-byte UTF-8 and tokens.

Text for new ids is the difference between decoding a small window with and without them
(the window keeps a few earlier tokens as context, so SentencePiece leading spaces and
byte-level pieces decode right). Text ending in an incomplete UTF-8 sequence (U+FFFD) is
held back until the next token completes it. Stop strings may span tokens: the last
`max(len(stop)) - 1` characters are held back until they can no longer start a stop string.

Byte-level BPE tokenizers (GPT-2 style, e.g. SmolLM2) take a faster path with the same result:
each id's bytes come from a table (`Tokenizer.byte_pieces`) and an incremental UTF-8 decoder
holds back an incomplete character, about 1 µs per token instead of two decodes of the window.
"""

from __future__ import annotations

import codecs

from lorafleet.scheduler.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), context: int = 5,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        """`skip_special_tokens` False: special tokens are spelt out in the text (and stop strings may match them).
        `include_stop` (vLLM's include_stop_str_in_output): the stop string that ended the text, or the text of the
        token that stopped the output, stays in it."""
        self.tok = tokenizer
        self.skip, self.include_stop = skip_special_tokens, include_stop
        self.pieces = tokenizer.byte_pieces(skip_special_tokens)
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self.pieces is not None else None
        self.ids = list(prompt_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # decoded, not yet emitted (may be the start of a stop string)
        self.stopped = False
        self.last_new = ""  # the text the last push decoded, before any is held back (log-probabilities' offsets)

    def _decode_new(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def push(self, new_ids: list[int], ending: bool = False) -> str:
        """Add generated ids; return text that can be shown now ("" if none). `ending`: the last id ended the
        output (EOS or one of stop_token_ids); it adds no text, special or not, as vLLM leaves the token that
        stopped the output out of its text (unless include_stop)."""
        if self.stopped:
            return ""
        if ending and new_ids and not self.include_stop:
            new_ids = new_ids[:-1]
            if not new_ids:
                self.last_new = ""
                return ""
        if self.pieces is not None:
            p = self.pieces
            text = self.utf8.decode(p[new_ids[0]] if len(new_ids) == 1 else b"".join([p[i] for i in new_ids]))
            self.last_new = text
            if not self.stop:  # nothing to hold back
                return text
            self.pending += text
            return self._emit(final=False)
        self.ids.extend(new_ids)
        self.last_new = self._decode_new()
        self.pending += self.last_new
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end: decode what is left, even an incomplete character."""
        if self.stopped:
            return ""
        if self.pieces is not None:
            self.pending += self.utf8.decode(b"", final=True)
            return self._emit(final=True)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        if len(full) > len(prefix):
            self.pending += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stop:
            hits = [(self.pending.find(s), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                # the text ends before the earliest stop string, or with include_stop after the one that was
                # complete first (the earliest end)
                end = min(i + len(s) for i, s in hits) if self.include_stop else min(hits)[0]
                out, self.pending, self.stopped = self.pending[:end], "", True
                return out
        if final or self.hold == 0:
            out, self.pending = self.pending, ""
        else:
            cut = max(0, len(self.pending) - self.hold)
            out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
