"""kvstream.model.tokenizer against transformers' GGUF tokenizer, on a tiny GGUF and on the real 0.5B one.

The real-model tests (mark ``real_model``) are skipped when the 0.5B's extra is not installed.
"""

from __future__ import annotations

import random

import gguf
import jinja2
import pytest

from kvstream.model.loader import GGUFError
from kvstream.model.stream_decoder import StreamDecoder
from kvstream.model.tokenizer import Tokenizer, TokenizerError, gguf_metadata
from tiny_vocab import add_tiny_vocab, tiny_vocab


CORPUS = [
    "",
    "hello world",
    "Hello",
    " leading space",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'class Foo:\n\tdef __init__(self, x: int = 42) -> None:\n\t\tself.x = x  # comment\n\n\n\nprint(f"{x!r:>10}")\n',
    '#include <stdio.h>\nint main(int argc, char **argv) {\n    printf("%s\\n", argv[0]);\n    return 0;\n}\n',
    "x = [1,2,3]; y = {'a': (4, 5)}; z = a->b && !c || d != e; w <<= 2; /* c */ // c++",
    "Hello, 世界! 你好，世界。こんにちは、カタカナ 안녕하세요",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 robot🤖🚀✨",
    "combining: e\u0301 cafe\u0301 café A\u030a Å n\u0303 z\u0336\u0335 \u0915\u094d\u0937",
    "naïve résumé Ωμέγα Привет мир مرحبا بالعالم नमस्ते สวัสดี",
    "a\n\n\nb",
    "trailing spaces   ",
    "   ",
    "\n",
    " \n \n  \n",
    "\t\tindented\ttabs\t",
    "windows\r\nline\r\n\r\nends",
    "mixed \t \n\t\n   end",
    "1234567890 3.14159 1e-10 0xDEADBEEF 2024-01-01 ١٢٣ ①②",
    "I'm you're it's we've they'll he'd DON'T Can'T o'clock",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_end|> <|im_start|>",
    "almost special <|im_start <im_end|> <|unknown|> < |im_end| >",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "nbsp\u00a0zero\u200bwidth\ufeffbom \u2028line sep\x00\x01\x7f",
    "=" * 100 + "\n" + "    " * 20 + "x",
    "```python\nimport os\nos.path.join('a', 'b')\n```",
]

CHATS = [
    [{"role": "user", "content": "Write a hello world in C."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 世界 🚀"},
    ],
]


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


def _write_tiny_gguf(path) -> None:
    """A GGUF with only what a tokenizer needs: the architecture (transformers picks its
    tokenizer class from it) and the tokenizer.* keys; no tensors."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    add_tiny_vocab(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    _write_tiny_gguf(path)
    return path


def _hf(path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return Tokenizer.from_gguf(tiny_path), _hf(tiny_path)


@pytest.fixture(scope="module")
def real(qwen05_path, qwen05_reader):
    return Tokenizer.from_gguf(qwen05_reader), _hf(qwen05_path)


@pytest.fixture(params=["tiny", pytest.param("real", marks=pytest.mark.real_model)])
def pair(request):
    """(ours, transformers') for each model."""
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------------------------------------
# parity with transformers
# ---------------------------------------------------------------------------------------------


def test_encode_decode_parity(pair):
    ours, hf = pair
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special=True) == hf.encode(text, add_special_tokens=True), text
        assert ours.decode(ids) == text
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True), text


def test_decode_arbitrary_ids_parity(pair):
    """Random id runs cut UTF-8 characters and mix in special tokens: same text as transformers
    (U+FFFD for broken bytes), and the stream decoder's output adds up to the same text."""
    ours, hf = pair
    rng = random.Random(0)
    specials = sorted(ours._special_ids) + [ours.token_texts.index("<tool_call>")]
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) if rng.random() < 0.9 else rng.choice(specials)
               for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            text = ours.decode(ids, skip_special=skip)
            assert text == hf.decode(ids, skip_special_tokens=skip), ids
            stream = StreamDecoder(ours, skip_special=skip)
            assert stream.extend(ids) + stream.flush() == text, ids


def test_vocabulary_and_special_ids(pair):
    ours, hf = pair
    assert ours.vocab_size == len(ours.token_texts) == len(hf)
    assert hf.get_vocab() == {t: i for i, t in enumerate(ours.token_texts)}
    assert ours.eos_id == hf.eos_token_id and ours.bos_id == hf.bos_token_id
    assert ours._special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert {i for i, t in hf.added_tokens_decoder.items() if not t.special} == {
        i for i, ty in enumerate(ours.token_types) if ty == 4
    }


def test_chat_template_parity(pair):
    ours, hf = pair
    for chat in CHATS:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )


@pytest.mark.real_model
def test_real_chat_template_with_tools(real):
    ours, hf = real
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    chat = CHATS[1] + [{"role": "assistant", "content": None,
                        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                       {"role": "tool", "content": "sunny"}]
    assert ours.apply_chat_template(chat, tools=tools) == hf.apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=True
    )


# ---------------------------------------------------------------------------------------------
# our own behaviour
# ---------------------------------------------------------------------------------------------


def test_tiny_vocab_is_valid():
    tokens, types, merges = tiny_vocab()
    assert 300 <= len(tokens) <= 400 and len(types) == len(tokens)
    assert tokens[:256] == _byte_symbols()
    vocab = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, m
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(special)] == 3


def _byte_symbols():
    from kvstream.model.gguf_vocab import bytes_to_unicode

    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and table[ord("!")] == "!" and table[ord(" ")] == "Ġ"
    return list(table.values())


def test_tiny_special_tokens(tiny):
    ours, _ = tiny
    tokens, _, _ = tiny_vocab()
    im_start, im_end, eot = (tokens.index(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert ours.encode("<|im_start|>user<|im_end|>")[0] == im_start
    assert ours.encode("<|im_start|>user<|im_end|>")[-1] == im_end
    assert ours.eos_id == im_end and ours.bos_id == eot
    assert ours.eog_ids == {im_end, eot}
    assert ours.decode([im_start, tokens.index("<tool_call>")], skip_special=True) == "<tool_call>"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.real_model
def test_real_eog_ids(real):
    ours, _ = real
    text = {i: ours.token_texts[i] for i in ours.eog_ids}
    assert sorted(text.values()) == sorted(
        ["<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    )
    assert ours.eos_id == ours.token_texts.index("<|im_end|>")
    assert "</s>" in ours.token_texts  # a plain text piece in this vocabulary, not an end


def test_from_reader_matches_from_path(tiny_path, tiny):
    ours, _ = tiny
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(tiny_path))
    assert from_reader.token_texts == ours.token_texts
    assert from_reader.source == str(tiny_path)
    for text in CORPUS:
        assert from_reader.encode(text) == ours.encode(text)


def test_stream_decoder_holds_partial_characters(tiny):
    ours, _ = tiny
    text = "世界🚀 é\u0301!"  # tiny vocab: every non-ASCII byte is its own token
    ids = ours.encode(text)
    stream = ours.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["", "", "世"]  # emitted when its third byte arrives
    cut = ours.stream_decoder()
    assert cut.extend(ids[:2]) == "" and cut.flush() == "\ufffd"


def test_add_special_uses_gguf_flags(tiny_path):
    meta = gguf_metadata(gguf.GGUFReader(tiny_path))
    meta["tokenizer.ggml.add_bos_token"] = True
    tok = Tokenizer(meta)
    assert tok.encode("hi", add_special=True) == [tok.bos_id] + tok.encode("hi")
    plain = Tokenizer.from_gguf(tiny_path)
    assert plain.encode("hi", add_special=True) == plain.encode("hi")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def meta(tiny_path):
    return gguf_metadata(gguf.GGUFReader(tiny_path))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model is 'llama'"),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["no_such_token x"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.pre": "deepseek-coder"}, "tokenizer.ggml.pre 'deepseek-coder'"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id"),
    ],
)
def test_bad_metadata_errors(meta, change, message):
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    with pytest.raises(TokenizerError, match=message.replace("(", r"\(")) as e:
        Tokenizer(meta, source="bad.gguf")
    assert "bad.gguf" in str(e.value)


def test_missing_chat_template_error(meta):
    del meta["tokenizer.chat_template"]
    tok = Tokenizer(meta, source="nochat.gguf")
    with pytest.raises(TokenizerError, match=r"nochat\.gguf.*tokenizer\.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_and_sandbox(meta):
    meta["tokenizer.chat_template"] = "{{ raise_exception('only user turns') }}"
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        Tokenizer(meta).apply_chat_template([])
    meta["tokenizer.chat_template"] = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(meta).apply_chat_template([])


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="x.gguf: not a readable GGUF"):
        Tokenizer.from_gguf(bad)
    with pytest.raises(TypeError):
        Tokenizer.from_gguf(42)

