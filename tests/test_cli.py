"""The generate command: config composition, typed config, and a real run on a tiny GGUF."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from kvstream.cli.generate import FREE_TEXT, run
from kvstream.config import GenerateConfig, quote_free_text, to_typed
from kvstream.engine.generate import generate
from kvstream.model.qwen import load_model
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.model.tokenizer import Tokenizer
from tiny_gguf import write_tiny_model

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "m.gguf")


def cfg_for(*overrides: str) -> GenerateConfig:
    overrides = list(overrides)
    quote_free_text(overrides, FREE_TEXT)  # as the command line does
    with initialize_config_module("conf", version_base=None):
        return to_typed(compose("generate", overrides=overrides), GenerateConfig)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("hardware", options("hardware"))
@pytest.mark.parametrize("cache", options("cache"))
def test_every_config_composes(model, hardware, cache):
    with initialize_config_module("conf", version_base=None):
        cfg = compose("generate", overrides=[f"model={model}", f"hardware={hardware}", f"cache={cache}"])
    assert cfg.model.source and cfg.hardware.device in ("cpu", "cuda") and cfg.cache.mode == cache
    if cfg.hardware.device == "cpu":
        to_typed(cfg, GenerateConfig)


def test_typed_config_rejects_bad_values():
    with pytest.raises(Exception, match="max_new_tokens"):
        cfg_for("max_new_tokens=0")
    with pytest.raises(Exception, match="hardware.dtype='float8'"):
        cfg_for("hardware.dtype=float8")
    with pytest.raises(Exception, match="no_such_key"):
        cfg_for("+no_such_key=1")


@pytest.mark.parametrize("override, message", [
    ("hardware.device=gpu", "hardware.device='gpu': give a torch device"),
    ("spec.draft.chunk=0", "spec.draft.chunk=0: catch-up tokens per draft pass, >= 1"),
    ("spec.draft.window=-1", "spec.draft.window=-1"),
    ("spec.draft.p_min=75", r"spec.draft.p_min=75.0: a probability in \[0, 1\]"),
    ("spec.draft.n_min=-1", "spec.draft.n_min=-1"),
    ("spec.draft.n_min=9", r"spec.draft.n_min=9 > spec.n_max=4: every draft would be dropped"),
    ("spec.draft.type_v=q5_0", "spec.draft.type_v='q5_0'; choose one of f16, q8_0, q4_0"),
    ("cache.mode=dense", "cache.mode='dense'; choose one of contiguous, resident, stream"),
    ("cache.type_k=q5_0", "cache.type_k='q5_0'; choose one of f16, q8_0, q4_0"),
    ("cache.residency=oldest", "cache.residency='oldest'; choose one of newest, sink_newest"),
    ("cache.residency_step=0", "cache.residency_step=0: give a whole number of pages >= 1"),
    ("cache.ring_pages=abc", "cache.ring_pages='abc': give a number of ring slots"),
    ("cache=stream cache.ring_pages=1", "cache.ring_pages=1: streaming needs >= 2 ring slots"),
    ("arena.mib=-5", "arena.mib=-5: give a positive size in MiB, or auto"),
    ("arena.mib=lots", "arena.mib='lots': give a positive size in MiB, or auto"),
    ("policy=keep_pages policy.keep_pages=0", "policy.keep_pages=0: give the pages per layer above which"),
    ("policy=auto policy.measure_batches=5", "policy.measure_batches=5: auto needs at least 6 batches"),
    ("policy=auto policy.min_gain=-0.1", "policy.min_gain=-0.1: a relative goodput gain, >= 0"),
    ("policy.stable_decodes=-1", "policy.stable_decodes=-1: decode batches between transitions"),
    ("policy.eject=sometimes", "policy.eject='sometimes'; choose one of onset, keep_pages, never, always, auto"),
    ("policy.draft_length=long", "policy.draft_length='long'; choose one of fixed, heuristic, goodput"),
    ("policy.chain_order=random", "policy.chain_order='random'; choose one of fixed, by_goodput"),
])
def test_bad_settings_name_the_key_and_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        cfg_for("spec=draft", "spec.n_max=4", *override.split())


def test_knobs_are_checked_where_the_run_reads_them():
    """Without speculation the spec numbers are not read; keep_pages only for its policy."""
    assert cfg_for("spec.n_max=99", "spec.draft.chunk=0").spec.n_max == 99
    assert cfg_for("policy.keep_pages=0", "policy.measure_batches=1").policy.keep_pages == 0
    with pytest.raises(ValueError, match="spec.draft.chunk=0"):
        cfg_for("spec=ngram-simple-draft", "spec.draft.chunk=0")
    cfg_for("spec=ngram-simple", "spec.draft.chunk=0")  # no draft model in the chain


def test_numbers_are_typed():
    cfg = cfg_for("cache=stream", "cache.ring_pages=8", "arena=fixed", "arena.mib=96")
    assert (cfg.cache.ring_pages, cfg.cache.ring_slots, cfg.arena.mib) == (8, 8, 96.0)
    assert isinstance(cfg.arena.mib, float) and cfg_for("arena.mib=auto").arena.mib == "auto"
    assert cfg_for("cache=stream").cache.ring_slots is None  # auto


def test_every_mode_refuses_a_context_beyond_the_model(tiny):
    """The contiguous cache too (it was built before the check): RoPE past the trained context."""
    from kvstream.cache.factory import make_cache
    model = load_model(tiny)
    n = model.cfg.context_length + 1
    for mode in ("contiguous", "resident"):
        cfg = cfg_for(f"cache={mode}")
        with pytest.raises(ValueError, match=f"context of {n} tokens .* exceeds the model's {n - 1}"):
            make_cache(cfg.cache, cfg.arena, model, n, 64)


def test_the_ring_size_must_be_a_number_or_auto(tiny):
    """make_cache checks it too, for callers whose CacheConfig was changed after its checks ran."""
    from kvstream.cache.factory import make_cache
    cfg = cfg_for("cache=stream")
    cfg.cache.ring_pages = "abc"
    with pytest.raises(ValueError, match="cache.ring_pages='abc': give a number of ring slots"):
        make_cache(cfg.cache, cfg.arena, load_model(tiny), 256, 64)


def test_free_text_overrides_are_quoted():
    argv = ["x", "prompt=def f(a): return 'b'\\n", "max_new_tokens=3"]
    quote_free_text(argv, ("prompt", "system"))
    assert argv[1] == "prompt='def f(a): return \\'b\\'\\n'"  # a backslash before no quote stays single
    assert argv[2:] == ["max_new_tokens=3"]


@pytest.mark.parametrize("cache", ["resident", "stream"])
def test_paged_caches_generate_like_the_contiguous_one(tmp_path, cache):
    from test_paged_cache import SPEC
    path = write_tiny_model(tmp_path / "m.gguf", SPEC)  # head_dim 64, as the paged kernels need
    outs = []
    for c in ("contiguous", cache):
        out = io.StringIO()
        run(cfg_for(f"model.source={path}", f"cache={c}", "cache.type_k=f16", "cache.type_v=f16",
                    "prompt=def add(a, b):", "max_new_tokens=8", "ignore_eos=true"), out)
        outs.append(out.getvalue().splitlines()[0])
    assert outs[0] == outs[1]  # fp16 pages vs the fp32 dense cache: same greedy tokens here
    assert re.search(r"^arena: [\d.]+ MiB \(slab [\d.]+, ring [\d.]+, pool [\d.]+, pinned 0.0, free [\d.]+ MiB\); "
                     r"\d+ of \d+ pages/layer resident$", out.getvalue(), re.M)


def test_speculative_generation_prints_the_same_greedy_text(tmp_path):
    from test_paged_cache import SPEC
    path = write_tiny_model(tmp_path / "m.gguf", SPEC)
    common = [f"model.source={path}", "prompt=" + "ab cd ef " * 30, "max_new_tokens=40", "ignore_eos=true"]
    plain, spec = io.StringIO(), io.StringIO()
    run(cfg_for(*common), plain)
    run(cfg_for(*common, "spec.type=ngram-simple,ngram-mod", "spec.n_max=8"), spec)
    assert spec.getvalue().splitlines()[0] == plain.getvalue().splitlines()[0]
    assert "spec ngram-simple:" in spec.getvalue() and "spec ngram-mod:" in spec.getvalue()
    with pytest.raises(Exception, match="spec.n_max=16"):
        cfg_for("spec=ngram-simple", "spec.n_max=16")
    with pytest.raises(Exception, match="draftmodel"):
        run(cfg_for(*common, "spec.type=draftmodel"), io.StringIO())


def test_run_prints_the_greedy_continuation_and_stats(tiny):
    cfg = cfg_for(f"model.source={tiny}", "prompt=def add(a, b):", "max_new_tokens=12", "ignore_eos=true")
    out = io.StringIO()
    run(cfg, out)
    text, stats = out.getvalue().rsplit("\n", 2)[:2]
    tok = Tokenizer.from_gguf(tiny)
    model = load_model(tiny)
    prompt = tok.encode("def add(a, b):")
    ref = generate(model, model.new_cache(64), prompt, 12, Sampler(cfg.sampling))
    assert text == tok.decode(ref.tokens)
    assert stats.startswith(f"prompt {len(prompt)} tok | prefill ") and "decode 12 tok" in stats


@pytest.mark.parametrize("ahead", [False, True])
def test_plain_step_records_hold_wall_time_between_steps(tiny, ahead):
    """A step record's step_s is the wall time since the previous step was queued, so host work
    between tokens (here a 20 ms on_token) is in it: with the host a step ahead that makes it
    the device's step time; the host's launch time alone would hide the device's."""
    model = load_model(tiny)
    g = generate(model, model.new_cache(64), [1, 2, 3, 4], 6, Sampler(SamplingParams()),
                 on_token=lambda t: time.sleep(0.02), run_ahead=ahead)
    assert len(g.records) == 5
    # ahead: the first step is queued before the first token is read, so nothing sleeps before it
    assert all(r.step_s >= 0.02 for r in g.records[ahead:])
    assert sum(r.step_s for r in g.records) <= g.stats.decode_s


@pytest.mark.parametrize("ahead", [False, True])
def test_a_stop_token_ends_the_output_its_logits_and_the_cache_together(tiny, ahead):
    """Stopping on a token: the tokens up to it, one kept logits row per token and the cache at the
    prompt plus the tokens fed, whether or not a step was queued after it (and rolled back)."""
    model, greedy, prompt = load_model(tiny), Sampler(SamplingParams(temperature=0)), [1, 2, 3, 4]
    ref = generate(model, model.new_cache(64), prompt, 12, greedy, keep_logits=True, run_ahead=False)
    first = next(i for i, t in enumerate(ref.tokens) if i >= 3 and t not in ref.tokens[:i])  # a token new at i
    cache = model.new_cache(64)
    g = generate(model, cache, prompt, 12, greedy, stop_ids=[ref.tokens[first]], keep_logits=True, run_ahead=ahead)
    assert g.tokens == ref.tokens[:first + 1] and g.stopped_on == ref.tokens[first]
    assert len(g.logits) == len(g.tokens) and all(torch.equal(a, b) for a, b in zip(g.logits, ref.logits))
    assert cache.length == len(prompt) + first and len(g.records) == first


def test_chat_template_and_sampling_run(tiny):
    cfg = cfg_for(f"model.source={tiny}", "chat=true", "system=Be brief.", "prompt=hi",
                  "sampling.temperature=0.8", "sampling.seed=5", "max_new_tokens=6")
    a, b = io.StringIO(), io.StringIO()
    run(cfg, a)
    run(cfg, b)
    assert a.getvalue().split("\n")[0] == b.getvalue().split("\n")[0]  # seeded: same text twice


def test_console_script(tiny):
    exe = shutil.which("kvstream-generate")
    cmd = [exe] if exe else [sys.executable, "-m", "kvstream.cli.generate"]
    r = subprocess.run(cmd + [f"model.source={tiny}", "prompt=def quicksort(a):", "max_new_tokens=5"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "prompt " in r.stdout and "tok/s" in r.stdout.splitlines()[-1]


def test_missing_model_is_a_clear_error(tmp_path):
    cfg = cfg_for(f"model.source={tmp_path / 'nope.gguf'}")
    with pytest.raises(FileNotFoundError, match="neither a registered name"):
        run(cfg, io.StringIO())
