"""Free-text overrides reach the model literally: backslashes, quotes, $, braces, commas and = included."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvstream.cli import generate as cli
from kvstream.config import quote_free_text
from kvstream.model.tokenizer import Tokenizer
from tiny_gguf import write_tiny_model

PROMPTS = [
    's = "a\\nb"',                       # a backslash escape inside a string literal
    "print('it''s')\\",                  # quotes, and a backslash before the closing quote
    "x\\'y \\\\' z",                     # backslash runs before quotes
    "f'{a}' ${HOME} ${oc.env:HOME} $1",  # braces and would-be interpolations
    "a=b, c=[1, 2], {'k': v}",           # Hydra's sweep, list and dict syntax
    "\\",                                # one lone backslash
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prompts") / "m.gguf")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_cli_entry_passes_prompts_through_unchanged(tiny, prompt, monkeypatch):
    """The real entry (argv quoting, Hydra's parser, OmegaConf's resolution, the typed config)."""
    seen = []
    monkeypatch.setattr(cli, "run", lambda cfg, out=None: seen.append(cfg))
    monkeypatch.setattr(sys, "argv", ["kvstream-generate", f"model.source={tiny}", f"prompt={prompt}",
                                      f"system={prompt}", "max_new_tokens=1"])
    cli.main()
    tok = Tokenizer.from_gguf(tiny)
    assert seen[0].prompt == prompt and seen[0].system == prompt
    assert tok.encode(seen[0].prompt) == tok.encode(prompt)


def test_the_console_script_tokenizes_the_prompt_as_given(tiny):
    prompt = PROMPTS[0] + " " + PROMPTS[3]
    r = subprocess.run([sys.executable, "-m", "kvstream.cli.generate", f"model.source={tiny}", f"prompt={prompt}",
                        "max_new_tokens=1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n = int(re.search(r"prompt (\d+) tok", r.stdout).group(1))
    assert n == len(Tokenizer.from_gguf(tiny).encode(prompt))


def test_quoting_leaves_other_overrides_alone():
    argv = ["x", "prompt='quoted'", "max_new_tokens=3", "+system=hi"]
    quote_free_text(argv, ("prompt", "system"))
    assert argv == ["x", "prompt='\\'quoted\\''", "max_new_tokens=3", "+system='hi'"]
