"""Incremental detokenization: output token ids in, text deltas out.

Two stages, each with a bounded cost per call whatever the length of the output:

1. Whole characters. Byte-level BPE splits one character (emoji, CJK) over several tokens, and
   decoding only some of them yields U+FFFD. We decode a small window of recent tokens, as
   vLLM does with prefix_offset/read_offset: `ids[prefix:read]` was passed on already and is
   decoded again only as context (SentencePiece decoders drop a leading space at the start of
   a decode); `ids[read:]` is pending. A cut that decodes to text ending in U+FFFD is taken to
   end inside a character and is held back.
2. Stop strings. Text that may still turn into a stop string is held back: the longest suffix
   that is a proper prefix of some stop string. So a match can only start in the held text or
   in the new text, and only that region is searched.

U+FFFD policy: a character has at most 4 bytes, and tokens straddling character boundaries
kept real text (CJK, Hindi, emoji ZWJ sequences, SmolLM2) at most 3 tokens pending. More than
MAX_PENDING_TOKENS pending tokens that still end in U+FFFD are taken to hold invalid bytes the
model really produced: they are emitted with their U+FFFD, up to the last cut that splits no
byte sequence (so the valid start of a character still to come stays pending). At the end,
flush() emits whatever is pending. So a model emitting garbage bytes never stalls the stream,
and for a byte-level tokenizer the deltas still add up to the full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    add_tokens() returns the text that is safe to emit now: never half a character, never any
    part of a stop string. Once a stop string appears, the text is cut just before it,
    `stopped` becomes True and later calls return "". When generation ends for another reason
    (EOS, length, abort), flush() returns what was held back; add_tokens() after flush()
    raises, unless a stop string was found. The deltas and flush() add up to
    `tokenizer.decode(ids, skip_special_tokens=...)`, cut at the stop string.

    With several stop strings, the one the model completed first wins; of those completed by
    the same character, the one that starts first. So the result does not depend on how the
    tokens are chunked.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop_filter = StopStringFilter(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0  # decoding starts here, for context
        self._read_offset = 0  # the text of ids[:read_offset] went to the stop filter
        self._pieces: list[str] = []  # the deltas; joined on demand to keep add_tokens O(1)
        self._flushed = False

    @property
    def stopped(self) -> bool:
        """A stop string was found; no more text will be emitted."""
        return self._stop_filter.stopped

    @property
    def text(self) -> str:
        """Everything emitted so far: the concatenation of all returned deltas."""
        return "".join(self._pieces)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids` to the output; return the new text that is safe to emit now."""
        if self.stopped:
            return ""
        if self._flushed:
            raise RuntimeError("add_tokens() called after flush()")
        if not token_ids:
            return ""
        num_checked = len(self._ids)
        self._ids.extend(token_ids)
        return self._emit(self._stop_filter.feed(self._complete_text(num_checked)))

    def flush(self) -> str:
        """Generation ended for a reason other than a stop string: emit what was held back,
        including any U+FFFD of bytes that never completed a character."""
        if self._flushed:
            return ""
        self._flushed = True
        if self.stopped:
            return ""
        tail = self._advance(len(self._ids))
        return self._emit(self._stop_filter.feed(tail) + self._stop_filter.release())

    def _complete_text(self, num_checked: int) -> str:
        """Text of the pending tokens up to the last cut that ends a character."""
        end = len(self._ids)
        # Cuts up to num_checked failed in earlier calls. If the last MAX_PENDING_TOKENS + 1
        # cuts all fail, the run is forced out below; so that many decodes at most per call.
        lowest = max(self._read_offset, num_checked, end - MAX_PENDING_TOKENS - 1)
        for cut in range(end, lowest, -1):
            text = self._decode(self._prefix_offset, cut)
            if not text.endswith(REPLACEMENT_CHAR):
                return self._advance(cut, text)
        if end - self._read_offset > MAX_PENDING_TOKENS:
            return self._advance(self._forced_cut(end))
        return ""

    def _forced_cut(self, end: int) -> int:
        """The last cut before `end` that splits no byte sequence, valid or not, of the pending
        text: decoding the two sides apart gives the same text as decoding them together.

        A lossy UTF-8 decoder turns each maximal invalid subpart into one U+FFFD, and a subpart
        that may still become a character reaches the end of the bytes; so a cut with bytes on
        both sides that passes now still passes when more tokens arrive, and a character whose
        start is pending is never broken.
        """
        whole = self._decode(self._prefix_offset, end)
        for cut in range(end - 1, self._read_offset, -1):
            tail = self._decode(cut, end)
            # An empty tail (skipped special tokens) puts the cut at the end of the bytes.
            if tail and self._decode(self._prefix_offset, cut) + tail == whole:
                return cut
        return end  # nothing to split on: never stall

    def _advance(self, cut: int, window_text: str | None = None) -> str:
        """Pass on the text of ids[read_offset:cut]; the window then starts at read_offset.
        `window_text`, if given, is the decode of ids[prefix_offset:cut]."""
        if cut <= self._read_offset:
            return ""
        if window_text is None:
            window_text = self._decode(self._prefix_offset, cut)
        context = self._decode(self._prefix_offset, self._read_offset)
        self._prefix_offset, self._read_offset = self._read_offset, cut
        return window_text[len(context) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


class StopStringFilter:
    """Passes text through, holding back what may still become a stop string, and cuts the
    text just before the first stop string completed."""

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        by_first: dict[str, list[str]] = {}
        for s in self._stop:
            by_first.setdefault(s[0], []).append(s)
        self._by_first_char = {c: tuple(ss) for c, ss in by_first.items()}
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add `text`; return the part of the held and new text that can be emitted now."""
        if self.stopped or not text:
            return ""
        if not self._stop:
            return text
        # No match can start before the held text: the held text is the longest suffix that
        # could start one. So searching held + new text finds the first match.
        window = self._held + text
        cut = self._first_match(window)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return window[:cut]
        keep = self._held_suffix_start(window)
        self._held = window[keep:]
        return window[:keep]

    def release(self) -> str:
        """No more text will come: the held text can no longer become a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, window: str) -> int | None:
        best: tuple[int, int] | None = None  # (end, start) of the first completed match
        for s in self._stop:
            start = window.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _held_suffix_start(self, window: str) -> int:
        """Start of the longest suffix of `window` that is a proper prefix of a stop string."""
        for i in range(max(0, len(window) - self._longest + 1), len(window)):
            n = len(window) - i
            candidates = self._by_first_char.get(window[i], ())
            if any(len(s) > n and window.startswith(s[:n], i) for s in candidates):
                return i
        return len(window)
