"""One line for a user's mistake, at every entry point (``kvstream-generate``, ``kvstream-ppl``,
``experiments.draft_threshold``, ``experiments.train_mtp``): ``PROG: error: MESSAGE`` on stderr,
exit code 2, no traceback; Ctrl-C: one line too. ``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows
the traceback instead.

Hydra reports errors itself: composition errors (an unknown group option, bad override syntax)
before the task function runs, the task's own after "Error executing job", and a sweep keeps a
failed cell's error until the sweep ends. :func:`main` has Hydra raise them instead, and
:func:`task` passes a known error through Hydra's job runner as a :class:`UserError`."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Callable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from kvstream.cache.host_store import HostMemoryTooSmall
from kvstream.model.registry import ModelNotAvailable

# a bad value or override, a missing / corrupt / unregistered file, a full disk, a KV store beyond the
# host's memory (ArenaTooSmall and GGUFError are ValueErrors)
KNOWN = (ValueError, OSError, ModelNotAvailable, HostMemoryTooSmall, HydraException, OmegaConfBaseException)

_debug = False


class UserError(BaseException):
    """A known error on its way out of Hydra: not an ``Exception``, so that Hydra's job runner,
    which catches those (and a sweep keeps them until it ends), lets it through."""


def one_line(e: BaseException) -> str:
    """The error's message on one line: OmegaConf's first line (the rest repeats its key), Hydra's
    option lists (``Available options in 'cache':`` then one a line) joined by commas, and the
    OmegaConf error a Hydra error was raised from."""
    text = str(e).split("\nConfig search path:")[0]
    text = re.sub(r"\n\t", ", ", re.sub(r":\n\t", ": ", text))
    lines = [s.strip() for s in text.splitlines() if s.strip()] or [type(e).__name__]
    if isinstance(e, OmegaConfBaseException):
        return lines[0]
    cause = e.__cause__
    tail = f": {one_line(cause)}" if isinstance(cause, OmegaConfBaseException) else ""
    return "; ".join(lines) + tail


def task(fn: Callable) -> Callable:
    """Wrap the function ``hydra.main`` runs: a known error leaves as a :class:`UserError`."""

    @functools.wraps(fn)
    def wrapped(cfg):
        try:
            return fn(cfg)
        except KNOWN as e:
            if _debug:
                raise
            raise UserError(one_line(e)) from None

    return wrapped


def main(prog: str, hydra_main: Callable[[], None], interrupted: Callable[[], str] = lambda: "interrupted") -> None:
    """Run ``hydra_main`` (a ``hydra.main``-decorated function) with the rules above;
    ``interrupted()`` is the Ctrl-C line (a sweep: how many cells are done, how to resume)."""
    global _debug
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        _debug = True
    _debug = _debug or os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises; the report is ours
    try:
        hydra_main()
    except UserError as e:
        fail(prog, str(e))
    except KNOWN as e:  # before the task function: composition, override syntax
        if _debug:
            raise
        bad = _unparsable(sys.argv[1:]) if isinstance(e, OverrideParseException) else None
        fail(prog, f"{bad}: {one_line(e)}" if bad else one_line(e))
    except KeyboardInterrupt:
        if _debug:
            raise
        print(f"{prog}: {interrupted()}", file=sys.stderr, flush=True)
        sys.exit(130)


def _unparsable(args: list[str]) -> str | None:
    """The first override that Hydra's grammar refuses (its error does not name it)."""
    parser = OverridesParser.create()
    for a in args:
        try:
            if not a.startswith("-"):
                parser.parse_overrides([a])
        except HydraException:
            return a
    return None


def fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
