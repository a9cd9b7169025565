"""The engine's token logprobs in OpenAI's shapes: chat's `choices[].logprobs.content[]` and the completions'
`choices[].logprobs` (tokens, token_logprobs, top_logprobs, text_offset), streamed chunk by chunk or whole.

As vLLM's server: a token's text is the tokenizer's decoding of that one token, a logprob of -inf (a token the
grammar or min_tokens forbids) is sent as -9999.0 (JSON has no infinity), and `text_offset` advances by the length
of each token's text. `bytes` are the token's exact bytes (a byte-level BPE token can hold part of a character,
whose text alone shows U+FFFD).
"""
from __future__ import annotations

from lab_utils.engine.logprobs import TokenLogprob

FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character each byte was written as -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenTexts:
    """token id -> (its text, its bytes), computed once per id (at most the vocabulary)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._bytes = _byte_decoder() if self.byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = None
            if self.byte_level:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is not None and all(ch in self._bytes for ch in piece):
                    raw = [self._bytes[ch] for ch in piece]
            hit = self._cache[token_id] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return hit


def _lp(x: float) -> float:
    return max(x, FLOOR)


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}, ...]}."""
    def one(token_id: int, logprob: float) -> dict:
        text, raw = texts(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], texts: TokenTexts,
                        offset: int = 0) -> tuple[dict, int]:
    """OpenAI's legacy shape for these tokens (an entry of None: the prompt's first token, which has no logprob)
    and the text offset after them (where the next chunk's tokens start). Each `top_logprobs` dict holds the k
    most likely tokens and the chosen one, so up to k + 1 entries, as OpenAI documents."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, e in zip(token_ids, entries):
        text, _ = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(e.logprob))
        top = {texts(t)[0]: _lp(lp) for t, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


class StreamLogprobs:
    """One stream's logprobs, chunk by chunk, in its endpoint's shape ("chat" or "text"); with `echo` (the prompt's
    text, completions only) the first chunk also carries the prompt: its text and, if asked, its logprobs."""

    def __init__(self, texts: TokenTexts, kind: str, echo: str | None = None) -> None:
        self.texts, self.kind, self.echo = texts, kind, echo
        self.offset = 0  # text_offset of the next token (completions)

    def take(self, out) -> tuple[str, dict | None]:
        """(text to put before this chunk's text, this chunk's `logprobs` or None if not asked)."""
        prefix, ids, entries = "", list(out.new_token_ids), out.new_logprobs
        if self.echo is not None:
            prefix, self.echo = self.echo, None
            if entries is not None and out.prompt_logprobs is not None:
                ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
        if entries is None:
            return prefix, None
        if self.kind == "chat":
            return prefix, chat_logprobs(entries, self.texts)
        shaped, self.offset = completion_logprobs(ids, entries, self.texts, self.offset)
        return prefix, shaped
