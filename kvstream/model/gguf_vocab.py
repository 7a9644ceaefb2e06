"""What a GGUF's ``tokenizer.*`` keys mean, as tables: token types, the pre-tokenizer split
regex of each ``tokenizer.ggml.pre`` name, the token texts llama.cpp stops generation on, and
GPT-2's byte alphabet (``bytes_to_unicode``). ``tokenizer.Tokenizer`` builds from them."""

from __future__ import annotations

from functools import lru_cache

__all__ = [
    "EOG_TEXTS",
    "FIM_EOG",
    "GPT2_PRE",
    "LLAMA3_SPLIT",
    "PRE_TOKENIZER_SPLITS",
    "QWEN2_SPLIT",
    "TOKEN_CONTROL",
    "TOKEN_NORMAL",
    "TOKEN_USER_DEFINED",
    "bytes_to_unicode",
]

# gguf.TokenType values, as stored in tokenizer.ggml.token_type
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; the names are llama.cpp's (same table as transformers').
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
         "smaug-bpe"),
        LLAMA3_SPLIT,
    ),
}
# pre-tokenizer names meaning GPT-2's own regex (ByteLevel's built-in one)
GPT2_PRE = (None, "default", "gpt2")

# Token texts llama.cpp treats as end-of-generation wherever they occur in a vocabulary
# (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation").
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
})
# FIM pad / repo / file-separator tokens: llama.cpp stops on these too (by key, else by name).
FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in its canonical order (printable bytes first).

    Byte-level BPE vocabularies spell every token with these 256 characters.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
