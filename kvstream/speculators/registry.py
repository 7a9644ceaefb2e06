"""Speculator config names: ``register``, ``create``, ``parse_chain_spec``, ``known_names``.

``register(name, factory)`` (also usable as a decorator) maps a config name to a factory;
``chain.build_chain("ngram-simple,draft", options)`` builds a chain from the comma string of
``spec.type`` (``none`` is the empty chain). Modules that register speculators at import
time are listed in ``BUILTIN_MODULES`` and imported lazily by the builders, so adding the
draft-model speculator is: write its module with ``@register("draft")`` on its factory and
append the module to ``BUILTIN_MODULES`` (or import it before building the chain).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from kvstream.speculators.base import Speculator

__all__ = [
    "BUILTIN_MODULES",
    "REGISTRY",
    "UnknownSpeculatorError",
    "create",
    "known_names",
    "normalize_name",
    "parse_chain_spec",
    "register",
]


SpeculatorFactory = Callable[..., Speculator]

#: config name -> factory(**options) -> Speculator
REGISTRY: dict[str, SpeculatorFactory] = {}

#: modules whose import registers speculators; imported on first use of the builders
BUILTIN_MODULES: list[str] = [
    "kvstream.speculators.ngram_simple",
    "kvstream.speculators.ngram_map_k",
    "kvstream.speculators.ngram_mod",
    "kvstream.speculators.draft",
    "kvstream.speculators.mtp",
]

NONE = "none"


class UnknownSpeculatorError(ValueError):
    """A speculator name that is not registered."""


def normalize_name(name: str) -> str:
    """Config spelling: case-insensitive, ``_`` and ``-`` alike (llama.cpp used both)."""
    return str(name).strip().lower().replace("_", "-")


def register(name: str, factory: SpeculatorFactory | None = None, *, replace: bool = False):
    """Register ``factory`` under ``name``; without ``factory`` it returns a decorator."""
    key = normalize_name(name)
    if key == NONE or not key:
        raise ValueError(f"{name!r} cannot be registered")

    def _do(f: SpeculatorFactory) -> SpeculatorFactory:
        old = REGISTRY.get(key)
        same = old is not None and (getattr(old, "__module__", None), getattr(
            old, "__qualname__", None)) == (getattr(f, "__module__", None),
                                            getattr(f, "__qualname__", None))
        if old is not None and old is not f and not (replace or same):  # same: a reload
            raise ValueError(f"speculator {key!r} is already registered")
        REGISTRY[key] = f
        return f

    return _do if factory is None else _do(factory)


def _load_builtins() -> None:
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)


def known_names() -> list[str]:
    """Every name a chain may use (``none`` included)."""
    _load_builtins()
    return [NONE, *sorted(REGISTRY)]


def _unknown(name: str) -> UnknownSpeculatorError:
    return UnknownSpeculatorError(
        f"unknown speculator {name!r}; known: {', '.join(known_names())}")


def create(name: str, **options: Any) -> Speculator:
    """One speculator from its registered name; ``options`` go to its factory."""
    _load_builtins()
    key = normalize_name(name)
    if key not in REGISTRY:
        raise _unknown(name)
    try:
        spec = REGISTRY[key](**options)
    except TypeError as e:
        raise ValueError(f"bad options for speculator {key!r} ({dict(options)}): {e}") from e
    spec.name = key
    return spec


def parse_chain_spec(spec: str | Sequence[str] | None) -> list[str]:
    """``"ngram-simple,draft"`` -> ``["ngram-simple", "draft"]``; ``none``/empty -> ``[]``.
    Unknown names, duplicates and ``none`` mixed with others are errors."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [normalize_name(s) for s in items]
    if isinstance(spec, str) and spec.strip() == "":
        return []
    if any(not n for n in names):
        raise ValueError(f"empty entry in speculator chain {spec!r}")
    if NONE in names:
        if len(names) > 1:
            raise ValueError(f"'none' cannot be combined with other speculators: {spec!r}")
        return []
    _load_builtins()
    for n, raw in zip(names, items):
        if n not in REGISTRY:
            raise _unknown(str(raw).strip())
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"speculator chain {spec!r} lists {', '.join(dup)} more than once")
    return names
