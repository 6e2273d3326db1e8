"""Turns a request's output tokens into text as they arrive, in O(1) work per token.

Technique (as in vLLM / TGI): keep two offsets into the token list. ``prefix_offset..read_offset``
is a short window of tokens whose text was already emitted; each step decodes that window alone and
the window plus the new tokens, and emits the difference. Decoding with a little left context (not
token by token) is what keeps spaces and multi-token characters right, and decoding only the window
(not the whole output) is what keeps the cost per token constant.

A decode that ends in U+FFFD may be a multi-byte UTF-8 character split across tokens; such text is
held back until a later token completes it (or :meth:`flush` ends the request), so a stream never
shows a partial character that a later step would have to retract.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
# A pending (incomplete but so far valid) UTF-8 character needs at most 3 more bytes, and every
# non-special token adds at least one byte: once this many real tokens follow a position, whatever
# was unfinished there is settled (completed or definitively invalid).
_SETTLE_TOKENS = 3
# After this many held-back tokens, try to release the settled part of a run of invalid bytes, so
# that garbage output (random ids, byte tokens that never form characters) cannot grow the window.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Streaming text of one request's output tokens.

    The concatenation of :meth:`push` deltas (followed by :meth:`flush` at the end) equals
    ``tokenizer.decode(output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``
    for byte-level BPE tokenizers. Two documented differences elsewhere: decoders that strip a
    leading space (SentencePiece's "▁") keep the first output token's space, because the prompt is
    decoded as context (so prompt + output reads right); and clean-up of tokenization spaces is never
    applied, because it rewrites text across window boundaries (transformers skips it for BPE anyway).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Only the prompt tail serves as context; earlier prompt tokens are never decoded again.
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._ids: list[int] = context
        self._num_context = len(context)
        self._special_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._prefix_offset = 0
        self._read_offset = len(context)
        if context and self._decode(0, len(context)).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or on an invalid byte). Context would let the first
            # output bytes complete that character, text that belongs to neither prompt nor output.
            self._prefix_offset = self._read_offset
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]  # keeps later joins proportional to the new chunks
        return self._text_cache

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_context

    @property
    def held_tokens(self) -> int:
        """Output tokens received whose text is not emitted yet (unfinished character, special tokens)."""
        return len(self._ids) - self._read_offset

    @property
    def window_tokens(self) -> int:
        """Tokens the next push will decode besides its new ones: stays small however long the output."""
        return len(self._ids) - self._prefix_offset

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add the step's new tokens; return the text that became final (possibly "")."""
        self._ids.extend(new_token_ids)
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, end)
        if not new_text.endswith(REPLACEMENT_CHAR):
            if len(new_text) > len(prefix_text) or end - self._read_offset > _MAX_HELD_TOKENS:
                return self._advance(new_text[len(prefix_text):], end)
            # Nothing visible yet (special tokens only): keep the window so context is not lost.
            return ""
        if end - self._read_offset > _MAX_HELD_TOKENS:
            return self._release_settled(prefix_text, new_text)
        return ""

    def flush(self) -> str:
        """Emit whatever is held back, unfinished characters included (call once, at the end)."""
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, end)
        return self._advance(new_text[len(prefix_text):], end)

    def _release_settled(self, prefix_text: str, new_text: str) -> str:
        # Find the last position followed by enough real tokens that its text can no longer change.
        settled, real_after = len(self._ids), 0
        while settled > self._read_offset and real_after < _SETTLE_TOKENS:
            settled -= 1
            if self._ids[settled] not in self._special_ids:
                real_after += 1
        if real_after < _SETTLE_TOKENS or settled <= self._read_offset:
            return ""
        settled_text = self._decode(self._prefix_offset, settled)
        # Not a prefix: the bytes before `settled` were completed by later ones; try again next step.
        if len(settled_text) <= len(prefix_text) or not new_text.startswith(settled_text):
            return ""
        return self._advance(settled_text[len(prefix_text):], settled)

    def _advance(self, delta: str, new_read_offset: int) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = new_read_offset
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )
