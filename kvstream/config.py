"""Typed run configuration: Hydra's DictConfig becomes these dataclasses at the entry point,
so nothing below an entry point ever sees a DictConfig.

The dataclasses are the schema and the one home of every default: ``register_schema`` puts
them in Hydra's ConfigStore, the primary configs in ``conf/`` list the schema first, and the
group files set only what their choice changes. Every range check is in a ``__post_init__``,
so ``to_typed`` refuses a bad value before any model is loaded; a knob is checked where the
run reads it (``spec.n_max`` only with speculation, ``policy.keep_pages`` only for
``keep_pages``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from kernels.formats import KV_TYPES
from kvstream.model.weights import WEIGHT_FORMATS
from policies import chain_order, draft_length, eject
from policies.residency import RESIDENCY

from kvstream.engine.draft_control import CHARGED, GOODPUT_MIN
from kvstream.model.sampling import SamplingParams
from kvstream.speculators.registry import parse_chain_spec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_MODES = ("contiguous", "resident", "stream")


def _choose(key: str, value: str, names) -> None:
    if value not in names:
        raise ValueError(f"{key}={value!r}; choose one of {', '.join(names)}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelSource:
    """The model file and its rope scaling. Each rope field left null is the GGUF's own
    (``{arch}.rope.scaling.type`` / ``.factor`` / ``.original_context_length``, the original
    context defaulting to ``{arch}.context_length``); one that is given overrides the file's.
    With YaRN the context limit is ``rope_factor x yarn_orig_ctx`` tokens."""

    source: str = "qwen2.5-coder-0.5b"  # a registered name or a path to a GGUF file
    rope_scaling: str | None = None     # none | yarn | null: the GGUF's
    rope_factor: float | None = None    # YaRN: context / original context (Qwen2.5: 4)
    yarn_orig_ctx: int | None = None    # YaRN: the context the model was trained at (Qwen2.5: 32768)
    max_context: int | None = None      # tokens a run may hold; null: the model's limit. Above it: a run past
    #                                     the context its rope was trained for, on purpose (results/long_context)
    weights: str = "dense"              # dense (hardware.dtype) | q8_0: matrices in q8_0 blocks, quantized from
    #                                     the file's values at load (kernels/q8_linear.py reads them on CUDA) |
    #                                     q8_0_int8: the same, and with model.gemv a decode row's activations in q8_0
    #                                     blocks too, multiplied in int8 as llama.cpp does (kernels/q8_gemv.py)
    gemv: bool = False                  # CUDA: the layers' single-row decode matmuls by kernels/gemv.py (dense) or
    #                                     kernels/q8_gemv.py (q8_0, the LM head's too), dense verify batches' by
    #                                     kernels/gemv_mma.py, the step's Triton kernels launched as programmatic
    #                                     dependents (PDL), in the target, a draft model and an MTP head
    #                                     (results/step/gemv: 1.5B step 1.78 -> 1.33 ms at 4K, dense)

    def __post_init__(self):
        if self.rope_scaling is not None:
            _choose("model.rope_scaling", self.rope_scaling, ("none", "yarn"))
        _choose("model.weights", self.weights, WEIGHT_FORMATS)
        if self.weights == "q8_0_int8" and not self.gemv:
            raise ValueError("model.weights=q8_0_int8 multiplies decode rows in int8 in model.gemv's kernel: "
                             "set model.gemv=true (or model.weights=q8_0)")
        if self.rope_factor is not None and not self.rope_factor >= 1:
            raise ValueError(f"model.rope_factor={self.rope_factor}: give a factor >= 1")
        if self.yarn_orig_ctx is not None and self.yarn_orig_ctx < 1:
            raise ValueError(f"model.yarn_orig_ctx={self.yarn_orig_ctx}: give the model's original context "
                             "in tokens, >= 1")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"model.max_context={self.max_context}: give a context in tokens, >= 1, or null")
        if self.rope_scaling == "none" and (self.rope_factor, self.yarn_orig_ctx) != (None, None):
            raise ValueError(f"model.rope_factor={self.rope_factor} / model.yarn_orig_ctx={self.yarn_orig_ctx} "
                             "apply to YaRN, not to model.rope_scaling=none")

    @property
    def rope(self) -> dict:
        """The rope overrides as ``read_config`` / ``load_model`` take them."""
        return dict(rope_scaling=self.rope_scaling, rope_factor=self.rope_factor, yarn_orig_ctx=self.yarn_orig_ctx,
                    max_context=self.max_context)

    @property
    def load(self) -> dict:
        """``load_model``'s keyword arguments: the rope overrides, the weight format and the matmuls."""
        return self.rope | {"weights": self.weights, "gemv": self.gemv}


@dataclass
class Hardware:
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"hardware.dtype={self.dtype!r}; choose one of {', '.join(DTYPES)}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"hardware.device={self.device!r}: give a torch device (cpu, cuda, cuda:1)") from None
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"hardware.device={self.device!r} but this torch build sees no CUDA device; "
                             "use hardware=cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class CacheConfig:
    mode: str = "contiguous"   # contiguous (dense, model dtype) | resident (paged, all on device) | stream
    type_k: str = "q8_0"       # f16 | q8_0 | q4_0
    type_v: str = "q4_0"
    # stream mode: ring slots (K/V page pairs, >= 2), two halves that alternate. auto: each half
    # holds every page a layer streams at full context (one attention call per layer), widened (up
    # to 4 MiB) by bytes no resident page can use, so layers streaming a few pages share one copy;
    # a number fixes it, and with it the pages per layer at every context
    ring_pages: int | str = "auto"
    residency: str = "newest"  # newest | sink_newest (policies/residency.py)
    # the oldest resident pages leave this many at a time: the streamed set, and with it the
    # captured step's copies, changes once per this many new pages (a plan and a copy update, ~1 ms),
    # at the price of up to step - 1 pool slots left empty until new pages fill them
    residency_step: int = 1
    # paged modes on CUDA: time each step's transfer wait (the steps' wait_s column; ring waits and
    # uploads, kvstream/cache/wait_clock.py) with two one-thread kernels around each wait: ~1 us a
    # wait, a few % of a streaming step's rate, so opt-in. CPU: always timed (free)
    time_waits: bool = False
    # paged modes: Q and K (when K is quantized) and V (when V is) multiplied by the orthonormal
    # Walsh-Hadamard matrix before K/V are quantized, the attention output rotated back, as llama.cpp
    # (0.3.36's attn_rot_k / attn_rot_v, on by default) does: it spreads Qwen's outlier key channels
    # over their blocks. Real 0.5B: q8_0 K's KLD ~3x lower, q4_0 K's ~2x higher (results/kv_quant_cost/llama)
    rotate: bool = False

    def __post_init__(self):  # here, so that a sweep's bad cell fails before its model loads
        if isinstance(self.ring_pages, str) and self.ring_pages.isdigit():  # a number given as text
            self.ring_pages = int(self.ring_pages)
        self.check()

    def check(self) -> None:
        """Every name and number known; also run by ``make_cache`` (a config may be changed after)."""
        _choose("cache.mode", self.mode, CACHE_MODES)
        _choose("cache.type_k", self.type_k, KV_TYPES)
        _choose("cache.type_v", self.type_v, KV_TYPES)
        _choose("cache.residency", self.residency, RESIDENCY)
        if not _whole(self.residency_step) or self.residency_step < 1:
            raise ValueError(f"cache.residency_step={self.residency_step!r}: give a whole number of pages >= 1")
        if not isinstance(self.time_waits, bool):
            raise ValueError(f"cache.time_waits={self.time_waits!r}: give true or false")
        if self.ring_pages != "auto" and not _whole(self.ring_pages):
            raise ValueError(f"cache.ring_pages={self.ring_pages!r}: give a number of ring slots (>= 2) or auto")
        if self.mode == "stream" and self.ring_pages != "auto" and self.ring_pages < 2:
            raise ValueError(f"cache.ring_pages={self.ring_pages}: streaming needs >= 2 ring slots (two halves), "
                             "or auto")

    @property
    def ring_slots(self) -> int | None:
        """``ring_pages`` as a number of slots (None: auto)."""
        return None if self.ring_pages == "auto" else self.ring_pages


@dataclass
class ArenaConfig:
    mib: float | int | str = "auto"  # MiB of the one device allocation, or auto: every page of the context fits

    def __post_init__(self):
        if self.mib == "auto":
            return
        try:
            mib = float(self.mib)  # a number, or a number given as text
        except (TypeError, ValueError):
            mib = None
        if isinstance(self.mib, bool) or mib is None or not 0 < mib < float("inf"):
            raise ValueError(f"arena.mib={self.mib!r}: give a positive size in MiB, or auto")
        self.mib = mib


@dataclass
class DraftConfig:
    source: str = "qwen2.5-coder-0.5b"  # the draft model: a registered name or a GGUF path (same vocabulary)
    type_k: str = "f16"        # draft KV types (pinned in the arena with the draft's weights)
    type_v: str = "f16"
    window: int = 0            # draft KV tokens (0: the whole context); full: restart on the newest half
    n_min: int = 0             # drafts shorter than this are dropped (llama.cpp's n_min)
    p_min: float = 0.75        # stop drafting when the draft's top probability falls below it
    chunk: int = 512           # catch-up tokens per draft forward pass (its compute slab)
    weights: str = "dense"     # the draft's matrices, as model.weights: dense (hardware.dtype) | q8_0 (0.53x the
    #                            pinned bytes) | q8_0_int8 (with model.gemv: decode rows multiplied in int8)

    def check(self, n_max: int) -> None:
        """Run by ``SpecConfig`` when the chain has a draft model (else these knobs are not read)."""
        _choose("spec.draft.type_k", self.type_k, KV_TYPES)
        _choose("spec.draft.weights", self.weights, WEIGHT_FORMATS)
        _choose("spec.draft.type_v", self.type_v, KV_TYPES)
        if self.chunk < 1:
            raise ValueError(f"spec.draft.chunk={self.chunk}: catch-up tokens per draft pass, >= 1")
        if self.window < 0:
            raise ValueError(f"spec.draft.window={self.window}: draft KV tokens, >= 0 (0: the whole context)")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"spec.draft.p_min={self.p_min}: a probability in [0, 1] (0: never stop early)")
        if self.n_min < 0:
            raise ValueError(f"spec.draft.n_min={self.n_min}: a number of draft tokens, >= 0")
        if self.n_min > n_max:
            raise ValueError(f"spec.draft.n_min={self.n_min} > spec.n_max={n_max}: every draft would be dropped")


@dataclass
class MTPConfig:
    source: str | None = None  # the head's GGUF (experiments.train_mtp writes one for its target)
    type_k: str = "f16"        # the head's KV types (its one layer, pinned in the arena with its weights)
    type_v: str = "f16"
    n_min: int = 0             # drafts shorter than this are dropped
    p_min: float = 0.0         # stop drafting when the head's top probability falls below it (0: never)

    def check(self, n_max: int) -> None:
        """Run by ``SpecConfig`` when the chain has an MTP head."""
        if not self.source:
            raise ValueError("spec.mtp.source is not set: give the head's GGUF (python -m experiments.train_mtp "
                             "writes one)")
        _choose("spec.mtp.type_k", self.type_k, KV_TYPES)
        _choose("spec.mtp.type_v", self.type_v, KV_TYPES)
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"spec.mtp.p_min={self.p_min}: a probability in [0, 1] (0: never stop early)")
        if not 0 <= self.n_min <= n_max:
            raise ValueError(f"spec.mtp.n_min={self.n_min}: a number of draft tokens in 0..spec.n_max ({n_max})")


@dataclass
class SpecConfig:
    type: str = "none"         # none | a speculator | a comma chain in priority order: ngram-simple,draft
    n_max: int = 15            # most draft tokens per round (a verify batch is 1 + n_max <= 16 tokens)
    synthetic_acceptance: float | None = None  # alpha: keep each draft token with this probability (timing only)
    draft: DraftConfig = field(default_factory=DraftConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def __post_init__(self):  # the numbers only where speculation reads them
        try:
            chain = parse_chain_spec(self.type)
        except ValueError as e:
            raise ValueError(f"spec.type={self.type!r}: {e}") from None
        if not chain:
            return
        if not 1 <= self.n_max <= 15:
            raise ValueError(f"spec.n_max={self.n_max}: a verify batch of 1 + n_max tokens must be 2..16")
        a = self.synthetic_acceptance
        if a is not None and not 0.0 <= a <= 1.0:
            raise ValueError(f"spec.synthetic_acceptance={a}: a probability in [0, 1], or null for real verification")
        if "draft" in chain:
            self.draft.check(self.n_max)
        if "mtp" in chain:
            self.mtp.check(self.n_max)
        if "draft" in chain and "mtp" in chain:
            raise ValueError(f"spec.type={self.type!r}: one pinned drafter at a time, the draft model or the MTP head")


@dataclass
class PolicyConfig:
    eject: str = "onset"       # onset | keep_pages | never | always | auto (policies/eject.py)
    keep_pages: int | None = None  # keep_pages: eject above this many pages per layer (no default: choose one)
    reenable_margin: int = 8   # onset, keep_pages: re-enable once the working set is this many pages below (0: off)
    stable_decodes: int = 4    # decode batches between transitions (0: off)
    probe_pages: int = 16      # auto: a goodput measurement is fresh within this many pages
    measure_batches: int = 8   # auto: decode batches in a state before its goodput is compared
    min_gain: float = 0.03     # auto: relative goodput gain needed to switch state
    trust_onset: bool = True   # auto: keep the draft while nothing streams (false: compare goodputs there too)
    horizon: bool = True       # auto: no transition the decode's remaining tokens cannot pay for (false: off)
    draft_length: str = "fixed"  # fixed (spec.n_max) | heuristic (+2 / -1) | goodput (policies/draft_length.py)
    chain_order: str = "fixed"   # fixed | by_goodput (policies/chain_order.py)

    def __post_init__(self):  # each number where the chosen policy reads it
        _choose("policy.eject", self.eject, eject.NAMES)
        _choose("policy.draft_length", self.draft_length, draft_length.POLICIES)
        _choose("policy.chain_order", self.chain_order, chain_order.POLICIES)
        if self.stable_decodes < 0:
            raise ValueError(f"policy.stable_decodes={self.stable_decodes}: decode batches between transitions, "
                             ">= 0 (0: off)")
        if self.eject == "keep_pages" and (self.keep_pages is None or self.keep_pages < 1):
            raise ValueError(f"policy.keep_pages={self.keep_pages}: give the pages per layer above which "
                             "keep_pages ejects, >= 1 (policy=always ejects at once)")
        if self.eject in ("onset", "keep_pages") and self.reenable_margin < 0:
            raise ValueError(f"policy.reenable_margin={self.reenable_margin}: pages below the threshold, >= 0 "
                             "(0: off)")
        if self.eject == "auto":
            least = CHARGED + GOODPUT_MIN
            if self.measure_batches < least:
                raise ValueError(f"policy.measure_batches={self.measure_batches}: auto needs at least {least} "
                                 f"batches in a state before comparing ({CHARGED} charged to the transition into "
                                 f"it, {GOODPUT_MIN} to measure its rate)")
            if self.probe_pages < 1:
                raise ValueError(f"policy.probe_pages={self.probe_pages}: pages within which a measurement is "
                                 "fresh, >= 1")
            if self.min_gain < 0:
                raise ValueError(f"policy.min_gain={self.min_gain}: a relative goodput gain, >= 0 (0.03: 3 %)")


@dataclass
class EngineConfig:
    cuda_graphs: bool = True   # CUDA: decode steps (target and draft) replay captured graphs; false: eager
    # CUDA, greedy, a draft model alone in the chain: a drafting round runs on the device with one
    # host sync (n draft steps, the p_min stop a mask, the verify and acceptance); false: the host
    # reads each draft token and verifies only the drafted ones
    device_rounds: bool = True


@dataclass
class GenerateConfig:
    model: ModelSource = field(default_factory=ModelSource)
    hardware: Hardware = field(default_factory=Hardware)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache: CacheConfig = field(default_factory=CacheConfig)
    arena: ArenaConfig = field(default_factory=ArenaConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prompt: str = "def quicksort(a):"
    chat: bool = False          # wrap the prompt in the GGUF's chat template
    system: str | None = None   # system message when chat=true
    max_new_tokens: int = 64
    prefill_chunk: int = 512    # prompt tokens per prefill forward pass
    ignore_eos: bool = False    # keep generating past end-of-generation tokens

    def __post_init__(self):
        drafts = "draft" in parse_chain_spec(self.spec.type)
        if drafts and self.spec.draft.weights == "q8_0_int8" and not self.model.gemv:
            raise ValueError("spec.draft.weights=q8_0_int8 multiplies the draft's decode rows in int8 in model.gemv's "
                             "kernel: set model.gemv=true (or spec.draft.weights=q8_0)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: give a number of tokens >= 1")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: give a number of tokens per pass >= 1")


T = TypeVar("T")


def register_schema(name: str, cls: type) -> None:
    """Store dataclass ``cls`` in Hydra's ConfigStore as ``name``: a primary config listing it
    first in its defaults gets every knob, typed and with its default."""
    ConfigStore.instance().store(name=name, node=cls)


def to_typed(cfg: DictConfig, cls: type[T]) -> T:
    """Validate ``cfg`` against dataclass ``cls`` (unknown keys and wrong types are errors)."""
    schema = OmegaConf.structured(cls)
    try:  # as plain values: a config composed on the schema keeps keys added with +key=value
        return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.to_container(cfg)))
    except ConfigKeyError as e:
        raise ValueError(f"unknown key {e.full_key!r}: {cls.__name__} has no such knob (every knob: docs/config.md)") from None


def hydra_literal(value: str) -> str:
    """``value`` as a quoted Hydra override value that composes back to exactly ``value``: Hydra
    keeps backslashes that precede no quote, so only a run of them before a quote (inner, or the
    closing one) is doubled; ``${`` is escaped so OmegaConf does not read it as an interpolation."""
    value = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    value = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    value = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, value)
    return f"'{value}'"


def quote_free_text(argv: list[str], keys: tuple[str, ...]) -> None:
    """Quote free-text overrides (``prompt=def f(a):``) in place so Hydra's override grammar takes
    them literally: backslashes, quotes, ``$``, braces, commas and ``=`` included."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+~") in keys:
            argv[i] = f"{key}={hydra_literal(value)}"


register_schema("generate_schema", GenerateConfig)
