"""Streaming text that adds up to the final text: incremental detokenization and stop-string hold-back.

Decoding the whole output at every chunk costs O(n) per token (O(n^2) per request). vLLM's way is O(1) per
token: keep two offsets into the output ids, `prefix` and `read`; decode the short window `ids[prefix:read]`
(text already sent) and `ids[prefix:]`, and send what the second adds to the first. A window that ends inside
a multi-byte character decodes to U+FFFD at its end: hold it until the next token completes it. The window
keeps the tokens of the last piece sent as left context, so tokenizers whose pieces depend on their left
neighbour (SentencePiece's leading space) decode the new piece as in the whole text, and it starts where the
text sent so far ended on a whole character, so decoding from there agrees with decoding the whole output.

Stop strings: the final text is cut before the first stop string, so a stream must never send one, nor the
start of one that the next tokens might complete. `StopHoldBack` keeps back the longest tail of the text that
is a prefix of some stop string, and stops sending at a complete one that no earlier-starting stop can still
overtake. Concatenated chunks == the final text.
"""
from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """`add(new_ids) -> new text`; `text` is everything decoded so far."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd") or not full.startswith(prefix_text):
            return ""  # nothing new yet, or a character is still incomplete: wait for the next token
        delta = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)  # the window now starts where the sent text ended
        self.text += delta
        return delta


def longest_partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (0 if none)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopHoldBack:
    """Decides how much of the text decoded so far may be sent: never a stop string, nor a possible start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of the text already sent
        self.stopped = False

    def release(self, text: str) -> str:
        """The next piece of `text` (all text decoded so far) that is safe to send."""
        if self.stopped:
            return ""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=len(text))
        # a longer stop string that starts before `cut` may still complete (if the engine does not stop at this
        # step, e.g. its stop check missed a stop split by a special token): hold back from where it would start
        partial = len(text) - longest_partial_stop(text, self.stops)
        end = min(cut, partial)
        self.stopped = end == cut < len(text)
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class StreamText:
    """One request's stream: `delta(new_ids)` per step, then `final(text)` with the engine's final text."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.hold = StopHoldBack(stops)
        self.sent = ""

    def delta(self, new_ids: Sequence[int]) -> str:
        self.detok.add(new_ids)
        piece = self.hold.release(self.detok.text)
        self.sent += piece
        return piece

    def final(self, text: str) -> str:
        """The rest of the engine's final text. It always extends what was sent (the same decode, the same
        stop cut); if it ever did not, the stream could not be fixed any more, so that is an error."""
        if not text.startswith(self.sent):
            raise RuntimeError(f"streamed text {self.sent[-40:]!r} is not a prefix of the final text {text[-40:]!r}")
        piece = text[len(self.sent):]
        self.sent = text
        return piece
