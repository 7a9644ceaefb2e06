"""One decode run from a typed config: cache, arena, speculator chain, policies, engine.

Shared by ``kvstream-generate`` and the experiments, so a sweep cell runs exactly what the
command line runs. Loaded models are passed in (a sweep loads them once); draft weights are
loaded on first use and kept (``DraftHosts``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from policies import chain_order, draft_length, eject

from kvstream.cache.factory import make_cache
from kvstream.config import GenerateConfig, PolicyConfig
from kvstream.engine.graphs import GraphedModel
from kvstream.engine.draft_control import DraftControl
from kvstream.engine.generate import Generation, generate
from kvstream.model.mtp_gguf import load_head
from kvstream.model.registry import MODELS, resolve_model, sha256_file
from kvstream.model.sampling import Sampler
from kvstream.engine.speculative import speculative_generate
from kvstream.speculators.chain import Chain, build_chain
from kvstream.speculators.draft import load_host
from kvstream.speculators.registry import parse_chain_spec
from kvstream.model.tokenizer import Tokenizer


class DraftHosts(dict):
    """Draft weights on the host by (source, dtype, device[, rope overrides][, gemv][, weights]), loaded once
    per process."""

    def get_host(self, source: str, tok: Tokenizer, dtype, device, rope: dict | None = None, gemv: bool = False,
                 weights: str = "dense"):
        rope = {k: v for k, v in (rope or {}).items() if v is not None}
        key = (source, str(dtype), str(device), *sorted(rope.items())) + ((("gemv", True),) if gemv else ()) \
            + ((("weights", weights),) if weights != "dense" else ())
        if key not in self:
            self[key] = load_host(resolve_model(source), tok.token_texts, dtype, device, gemv, weights, **rope)
        return self[key]


DRAFT_HOSTS = DraftHosts()


def mtp_head(source: str, target, target_source: str):
    """An MTP head for ``target`` from its GGUF (``load_head`` refuses one made for another target)."""
    if not Path(source).is_file():
        raise FileNotFoundError(f"spec.mtp.source={source}: no such file (python -m experiments.train_mtp writes a head)")
    path = resolve_model(target_source)
    sha = MODELS[target_source].sha256 if target_source in MODELS else _sha256(path)
    return load_head(source, target, sha)[0]


@functools.cache
def _sha256(path) -> str:
    return sha256_file(path)


@dataclass
class RunResult:
    generation: Generation
    chain: Chain | None
    control: DraftControl | None
    cache: object


def eject_policy(p: PolicyConfig):
    """The eject policy ``p`` names, with its hysteresis (``p`` was checked when it was built)."""
    return eject.build(p.eject, keep_pages=p.keep_pages, reenable_margin=p.reenable_margin,
                       stable_decodes=p.stable_decodes, probe_pages=p.probe_pages, measure_batches=p.measure_batches,
                       min_gain=p.min_gain, trust_onset=p.trust_onset, horizon=p.horizon)


def cache_tokens(n_prompt: int, max_new_tokens: int, spec, context_length: int) -> int:
    """The tokens a run's caches hold: with speculation, a verify batch may run up to ``spec.n_max``
    tokens past the last one kept (the decode's last round keeps the usual width), within the
    model's context (there the last round narrows to what fits)."""
    n = n_prompt + max_new_tokens
    return max(n, min(n + (spec.n_max if spec.type != "none" else 0), context_length))


def run_decode(cfg: GenerateConfig, model, tok: Tokenizer, prompt: list[int], *, on_token=None,
               progress: bool = False, hosts: DraftHosts = DRAFT_HOSTS) -> RunResult:
    """Decode ``cfg.max_new_tokens`` after ``prompt`` as ``cfg`` says."""
    spec, max_tokens = cfg.spec, cache_tokens(len(prompt), cfg.max_new_tokens, cfg.spec, model.cfg.context_length)
    speculating = spec.type != "none"
    chain_names = parse_chain_spec(spec.type) if speculating else []
    graphs = cfg.engine.cuda_graphs and model.device.type == "cuda"
    step = GraphedModel(model) if graphs else model  # the same forward pass, captured or eager
    stop = () if cfg.ignore_eos else tok.eog_ids
    sampler = Sampler(cfg.sampling, cfg.hardware.device)
    options = {}
    if "draft" in chain_names:
        d = spec.draft
        # the draft reads the target's positions: the target's rope overrides (YaRN past the original context)
        # and the target's matmuls (model.gemv)
        options["draft"] = dict(host=hosts.get_host(d.source, tok, model.dtype, model.device, cfg.model.rope,
                                                    cfg.model.gemv, d.weights),
                                device=model.device,
                                max_tokens=max_tokens, type_k=d.type_k, type_v=d.type_v, window=d.window,
                                n_min=d.n_min, p_min=d.p_min, chunk=d.chunk, sampling=cfg.sampling, graphs=graphs,
                                max_width=1 + spec.n_max)
    if "mtp" in chain_names:
        m = spec.mtp
        options["mtp"] = dict(head=mtp_head(m.source, model, cfg.model.source), device=model.device,
                              max_tokens=max_tokens, type_k=m.type_k, type_v=m.type_v, p_min=m.p_min, n_min=m.n_min,
                              graphs=graphs, max_width=1 + spec.n_max)
    chain = build_chain(spec.type, options) if speculating else None
    pinned = next((chain.get(n) for n in ("draft", "mtp") if n in options), None)  # the one pinned drafter
    # the target's passes return the hidden states an MTP head reads: their buffers are in the slabs
    hidden = chain.get("mtp").wants_hidden if "mtp" in options else False
    cache = make_cache(cfg.cache, cfg.arena, model, max_tokens, cfg.prefill_chunk,
                       verify_width=1 + spec.n_max if speculating else 1, hidden=hidden,
                       # only an automatic arena sizes itself around the draft (on CUDA the estimate
                       # measures the draft's slabs with its weights on the device for a moment)
                       pinned_bytes=pinned.estimated_bytes() if pinned is not None and cfg.arena.mib == "auto" else 0)
    if not speculating:
        return RunResult(generate(step, cache, prompt, cfg.max_new_tokens, sampler, stop_ids=stop,
                                  prefill_chunk=cfg.prefill_chunk, on_token=on_token), None, None, cache)
    control = None
    if pinned is not None:
        control = DraftControl(pinned, cache, eject_policy(cfg.policy), measure_in_place=len(chain) == 1)
    p = cfg.policy
    g = speculative_generate(
        step, cache, prompt, cfg.max_new_tokens, sampler, chain, n_max=spec.n_max, stop_ids=stop,
        prefill_chunk=cfg.prefill_chunk, on_token=on_token, synthetic_acceptance=spec.synthetic_acceptance,
        length_policy=draft_length.build(p.draft_length, n=spec.n_max) if p.draft_length == "fixed"
        else draft_length.build(p.draft_length),
        order_policy=chain_order.build(p.chain_order), control=control, progress=progress,
        device_rounds=cfg.engine.device_rounds and model.device.type == "cuda")
    return RunResult(g, chain, control, cache)

