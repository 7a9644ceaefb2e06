"""The arena size that puts the streaming onset where a study wants it: the MiB at which the
decode layout, with the draft pinned, holds exactly N resident pages per layer.

    python -m experiments.size_arena experiment=draft_threshold_h200_synthetic context=32000 +pages=32

Takes the study's config (same overrides as ``experiments.draft_threshold``), lays out one
generous arena with the draft pinned (the real slab reserve pass and pin), then removes the
bytes of the pages beyond N and checks the result. Prints ``arena.mib=...``.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from hydra import compose, initialize_config_module

from experiments.common import load_target
from experiments.draft_threshold import StudyConfig
from kvstream.cache.arena import MIB, ArenaPlan
from kvstream.cache.factory import make_cache
from kvstream.config import quote_free_text, to_typed
from kvstream.engine.draft_control import DraftControl
from kvstream.engine.runner import DRAFT_HOSTS, cache_tokens
from kvstream.speculators.draft import DraftModel
from policies.eject import Never


def capacity_with_draft(cfg: StudyConfig, mib: float) -> tuple[int, object]:
    model, tok, _ = load_target(cfg)
    d = cfg.spec.draft
    max_tokens = cache_tokens(cfg.context, cfg.max_new_tokens, cfg.spec, model.cfg.context_length)
    host = DRAFT_HOSTS.get_host(d.source, tok, model.dtype, model.device)
    cache = make_cache(cfg.cache, replace(cfg.arena, mib=mib), model, max_tokens, cfg.prefill_chunk,
                       verify_width=1 + cfg.spec.n_max)
    draft = DraftModel(host, model.device, max_tokens=max_tokens, type_k=d.type_k, type_v=d.type_v, window=d.window,
                       chunk=d.chunk)
    control = DraftControl(draft, cache, Never())
    cache.set_phase("decode")
    return cache.capacity, control


def arena_for(cfg: StudyConfig, pages: int, generous_mib: float) -> float:
    """MiB whose decode layout holds ``pages`` pages per layer with the draft pinned."""
    cap, control = capacity_with_draft(cfg, generous_mib)
    layout = control.cache.layout
    if cap < pages:
        raise ValueError(f"even {generous_mib} MiB holds only {cap} pages/layer with the draft; give more")
    # the layout's slab, ring and pins with exactly the wanted pages, and half a page pair more: room
    # for the pins' alignment in another arena and the printed rounding, short of another page
    plan = ArenaPlan(layout.slab, layout.ring_pages, layout.pair, layout.pinned)
    mib = (plan.bytes(pages * control.cache.n_layers) + layout.pair // 2) / MIB
    got, _ = capacity_with_draft(cfg, mib)
    if got != pages:
        raise RuntimeError(f"sized {mib:.2f} MiB for {pages} pages/layer but it holds {got}")
    return mib


def main() -> None:
    argv = sys.argv[1:]
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("+pages=")), None)
    if given is None or not given.isdigit() or int(given) < 1:
        sys.exit(f"size_arena: give +pages=N, the resident pages per layer wanted with the draft pinned (N >= 1); "
                 f"got {given!r}")
    pages = int(given)
    generous = next((float(a.split("=", 1)[1]) for a in argv if a.startswith("+generous_mib=")), 4096.0)
    overrides = [a for a in argv if not a.startswith("+")]
    quote_free_text(overrides, ("instruction", "spec.type"))
    with initialize_config_module("conf", version_base=None):
        cfg = to_typed(compose("draft_threshold", overrides=overrides), StudyConfig)
    print(f"arena.mib={arena_for(cfg, pages, generous):.2f}")


if __name__ == "__main__":
    main()
