"""A tiny byte-level BPE vocabulary (Qwen2-style) for tiny test models.

``tiny_vocab()`` gives ``(tokens, token_types, merges)``: the 256 byte symbols in GPT-2's
``bytes_to_unicode`` order (ids 0-255), merges learnt from a small code corpus (their results
follow, in merge order), then the ChatML special tokens. ``add_tiny_vocab(writer)`` writes it as
the ``tokenizer.*`` keys of a GGUF (model "gpt2", pre "qwen2"), as llama.cpp's converter would.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from kvstream.model.gguf_vocab import QWEN2_SPLIT, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, bytes_to_unicode

N_MERGES = 96

# CONTROL tokens (special) and USER_DEFINED ones (matched whole, not special), as in Qwen2.5.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<tool_call>", "</tool_call>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = '''\
def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

for i in range(10):
    print(f"value {i} = {fibonacci(i)}")

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        printf("%s\\n", argv[i]);
    }
    return 0;
}
The quick brown fox jumps over the lazy dog. It's the return value that matters.
'''


@lru_cache(maxsize=1)
def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)`` of the tiny vocabulary (deterministic, ~360 tokens)."""
    from tokenizers import Regex, pre_tokenizers

    byte_symbols = list(bytes_to_unicode().values())
    # Split the corpus the way the model's pre-tokenizer will, so merges never cross word edges.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    words = Counter(w for w, _ in pre.pre_tokenize_str(_CORPUS))
    seqs = {w: list(w) for w in words}
    merges, learnt = [], []
    for _ in range(N_MERGES):
        pairs = Counter()
        for w, count in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:]):
                pairs[pair] += count
        if not pairs:
            break
        # most frequent pair; ties broken by the pair itself so the result is deterministic
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        learnt.append(a + b)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    tokens = byte_symbols + learnt + list(CONTROL_TOKENS) + list(USER_DEFINED_TOKENS)
    types = (
        [TOKEN_NORMAL] * (len(byte_symbols) + len(learnt))
        + [TOKEN_CONTROL] * len(CONTROL_TOKENS)
        + [TOKEN_USER_DEFINED] * len(USER_DEFINED_TOKENS)
    )
    assert len(set(tokens)) == len(tokens), "tiny vocabulary has duplicate tokens"
    return tokens, types, merges


def add_tiny_vocab(writer, chat_template: str = CHATML_TEMPLATE) -> None:
    """Add every ``tokenizer.*`` key of the tiny vocabulary to a ``gguf.GGUFWriter``.

    Special ids as in Qwen2.5-Instruct: eos ``<|im_end|>``, bos and padding ``<|endoftext|>``,
    no BOS added when encoding.
    """
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
