"""Text <-> token ids for a GGUF model, built from the tokenizer the GGUF's metadata describes.

A GGUF carries no ``tokenizer.json``: the vocabulary, merges, token types, special ids and chat
template sit in its ``tokenizer.*`` keys. :class:`Tokenizer` rebuilds from them the same
``tokenizers`` pipeline that transformers builds for ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)`` (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so ids match it:

* model: byte-level BPE over ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``; no unknown
  token, no byte fallback, no dropout;
* normalizer: none. (Qwen2's own ``tokenizer.json`` applies NFC; transformers' GGUF path and
  llama.cpp do not, and text with combining marks tokenizes differently with and without it.)
* pre-tokenizer: the regex split named by ``tokenizer.ggml.pre``, then ``ByteLevel`` without
  its own regex or a prefix space;
* added tokens: CONTROL tokens are special, USER_DEFINED ones plain added tokens; both are
  matched whole in the input text;
* decoder: ``ByteLevel``.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, as used by Qwen2/Llama-3-style models)
is supported. The tables of what the keys mean are in ``gguf_vocab``, the chat template is
compiled by ``chat_template``, and ``Tokenizer.stream_decoder`` returns a
``stream_decoder.StreamDecoder``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from kvstream.model.chat_template import compile_chat_template
from kvstream.model.gguf_vocab import (
    EOG_TEXTS,
    FIM_EOG,
    GPT2_PRE,
    PRE_TOKENIZER_SPLITS,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    bytes_to_unicode,
)
from kvstream.model.loader import open_gguf
from kvstream.model.stream_decoder import StreamDecoder

__all__ = ["gguf_metadata", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """A GGUF whose tokenizer metadata is missing, malformed or of an unsupported kind."""


def gguf_metadata(reader) -> dict[str, Any]:
    """Plain-Python metadata from a ``gguf.GGUFReader`` (reusing a reader the caller already has)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model.

    Build it with :meth:`from_gguf` (a path or a ``gguf.GGUFReader``) or directly from a metadata
    mapping (``{"tokenizer.ggml.tokens": [...], ...}``); ``source`` names the file in errors.
    """

    def __init__(self, metadata: Mapping[str, Any], source: str = "<metadata>"):
        self.source = source
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{source}: no tokenizer in the GGUF (key tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported"
            )
        tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
        if not tokens:
            raise TokenizerError(f"{source}: no vocabulary (tokenizer.ggml.tokens is missing or empty)")
        merges = metadata.get("tokenizer.ggml.merges")
        if not merges:
            raise TokenizerError(f"{source}: byte-level BPE needs tokenizer.ggml.merges, which is missing or empty")
        types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        pre = metadata.get("tokenizer.ggml.pre")
        if pre not in GPT2_PRE and pre not in PRE_TOKENIZER_SPLITS:
            # transformers silently falls back to GPT-2's regex here, which splits text differently
            # from the model's own pre-tokenizer; refuse rather than mis-tokenize.
            raise TokenizerError(
                f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
                f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}, default)"
            )

        self.token_texts: list[str] = tokens
        self.token_types: list[int] = types
        self.vocab_size = len(tokens)
        self.eos_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.bos_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.pad_id: int | None = metadata.get("tokenizer.ggml.padding_token_id")
        self.unk_id: int | None = metadata.get("tokenizer.ggml.unknown_token_id")
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        for key, tid in (("eos", self.eos_id), ("bos", self.bos_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise TokenizerError(f"{source}: tokenizer.ggml.{key}_token_id {tid} is outside the vocabulary")

        self._backend = self._build_backend(tokens, types, merges, pre)
        self.eog_ids: frozenset[int] = self._eog_ids(metadata)
        self._special_ids = frozenset(
            i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        )
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._piece_cache: dict[int, bytes] = {}
        self._template = None

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        """Tokenizer of a GGUF file, given its path or an open ``gguf.GGUFReader``."""
        if isinstance(path_or_reader, (str, os.PathLike)):
            return cls(gguf_metadata(open_gguf(path_or_reader)), source=os.fspath(path_or_reader))
        if hasattr(path_or_reader, "fields"):
            source = getattr(getattr(path_or_reader, "data", None), "filename", None) or "<GGUFReader>"
            return cls(gguf_metadata(path_or_reader), source=str(source))
        raise TypeError(f"from_gguf takes a path or a gguf.GGUFReader, not {type(path_or_reader).__name__}")

    def _build_backend(self, tokens, types, merges, pre) -> _Backend:
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        # A token with a character outside the byte alphabet is stored as plain text; BPE only
        # ever produces alphabet spellings, so key it by the spelling of its UTF-8 bytes.
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        try:
            model = BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ", 1)) for m in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        except Exception as e:  # tokenizers reports a bad merge table without naming the file
            raise TokenizerError(f"{self.source}: invalid tokenizer.ggml.merges: {e}") from e
        backend = _Backend(model)
        split = PRE_TOKENIZER_SPLITS.get(pre)
        backend.pre_tokenizer = (
            pre_tokenizers.ByteLevel(add_prefix_space=False)
            if split is None
            else pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        )
        backend.decoder = decoders.ByteLevel()
        # Control tokens spelled outside the byte alphabet are skipped, as transformers does: they
        # are llama.cpp mislabels, and adding them as written would create new ids.
        backend.add_special_tokens([
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_CONTROL and set(t) <= alphabet
        ])
        backend.add_tokens([
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_USER_DEFINED and t in vocab
        ])
        # transformers' Qwen2Tokenizer also makes the bos/eos/unk/pad tokens special, whatever
        # their type in the file.
        named = {self.bos_id, self.eos_id, self.pad_id, self.unk_id} - {None}
        backend.add_special_tokens([
            AddedToken(tokens[i], normalized=False, special=True)
            for i in sorted(named)
            if 0 <= i < len(tokens) and vocab.get(tokens[i]) == i
        ])
        return backend

    def _eog_ids(self, meta: Mapping[str, Any]) -> frozenset[int]:
        """End-of-generation ids, chosen the way llama.cpp chooses them."""
        index = {t: i for i, t in enumerate(self.token_texts)}
        # Unlike llama.cpp, a NORMAL token is never picked by name: Qwen2's vocabulary has '</s>'
        # (id 128247) as a plain text piece (an HTML tag), and stopping on it would cut code short.
        marked = {t for t, i in index.items() if self.token_types[i] != TOKEN_NORMAL}
        eog = {index[t] for t in EOG_TEXTS & marked}
        for key, names in FIM_EOG.items():
            tid = meta.get(key)
            if tid is None:
                tid = next((index[n] for n in names if n in marked), None)
            if tid is not None:
                eog.add(tid)
        for key in ("eos", "eot", "eom"):
            if (tid := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
                eog.add(tid)
        # gpt-oss / solar-open: '<|end|>' ends a message, not the generation, when these exist
        if ("<|return|>" in index and "<|call|>" in index) or ("<|calls|>" in index and "<|flush|>" in index):
            eog.discard(index.get("<|end|>"))
        if "<|tool_response>" in index:  # gemma4: '</s>' is not an end of generation there
            eog.discard(index.get("</s>"))
        return frozenset(eog)

    # -- encoding / decoding ------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) become their ids.

        ``add_special`` adds BOS/EOS where the GGUF asks for them (tokenizer.ggml.add_bos_token /
        add_eos_token), as llama.cpp and transformers do.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (special tokens: their text in UTF-8)."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            text = self._backend.id_to_token(token_id)
            if text is None:
                raise IndexError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
            # as the ByteLevel decoder does: alphabet characters are bytes, anything else is itself
            piece = b"".join(
                bytes((self._byte_of[c],)) if c in self._byte_of else c.encode("utf-8") for c in text
            )
            self._piece_cache[token_id] = piece
        return piece

    def is_special(self, token_id: int) -> bool:
        """True for special (control) tokens, the ones ``skip_special`` drops."""
        return token_id in self._special_ids

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    # -- chat template ------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the GGUF's ``tokenizer.chat_template`` like transformers'
        ``apply_chat_template(..., tokenize=False)``: a sandboxed jinja2 environment with
        ``raise_exception``/``strftime_now``, a ``tojson`` that keeps non-ASCII, the special token
        strings (``bos_token``, ``eos_token``, ...), ``tools=None`` and ``documents=None``.
        Extra keyword arguments are passed to the template.
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: the GGUF has no chat template (key tokenizer.chat_template)")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        # transformers drops None-valued keys: templates test for presence, not for None
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        named = {
            f"{name}_token": self.token_texts[tid]
            for name, tid in (("bos", self.bos_id), ("eos", self.eos_id), ("unk", self.unk_id), ("pad", self.pad_id))
            if tid is not None
        }
        context = {"tools": None, "documents": None, **named, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
