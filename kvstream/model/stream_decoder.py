"""Incremental detokenization (``StreamDecoder``): token ids in, complete UTF-8 text out."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstream.model.tokenizer import Tokenizer

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Incremental detokenizer: feed ids one by one, get the text that is complete so far.

    Works on bytes, so a multi-byte UTF-8 character split across tokens is emitted once its last
    byte arrives; the concatenated output equals ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the newly printable text (possibly empty)."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def extend(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: any incomplete trailing character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
