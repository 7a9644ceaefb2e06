"""A code corpus every machine has: the Python sources of this interpreter's standard library and
installed site-packages (``sysconfig.get_paths()``), split train / held-out by file.

A file is named by ``<root key>/<path relative to that root>``; a root nested in another
(site-packages in stdlib) is walked only as itself. The split is a stable hash of that name,
so a file stays on its side whatever else is installed; each side's order is the sorted names
shuffled with the seed. Here rather than in the training app: the held-out side is the code on
which a head's acceptance is measured too.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from pathlib import Path

import numpy as np
import torch

ROOTS = ("stdlib", "purelib", "platlib")


def python_sources(roots: tuple[str, ...] = ROOTS) -> dict[str, Path]:
    """Name -> path of every ``*.py`` under the roots (sysconfig keys or directories), sorted by name.
    A root's walk skips the other roots inside it (site-packages inside stdlib)."""
    paths = sysconfig.get_paths()
    dirs = {}
    for r in roots:
        d = Path(paths.get(r, r)).resolve()
        if not d.is_dir():
            raise FileNotFoundError(f"corpus root {r!r} ({d}) is not a directory; give a sysconfig key "
                                    f"({', '.join(sorted(paths))}) or a directory")
        dirs.setdefault(d, r)
    known = set(dirs) | {Path(paths[r]).resolve() for r in ROOTS}
    files = {}
    for d, key in dirs.items():
        for top, subdirs, names in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if Path(top, s).resolve() not in known)
            files |= {f"{key}/{Path(top, n).relative_to(d).as_posix()}": Path(top, n) for n in names if n.endswith(".py")}
    return dict(sorted(files.items()))


def split_files(files: dict[str, Path], held_out: float, seed: int) -> tuple[list[Path], list[Path]]:
    """(train, held-out) paths: a file is held out when the hash of its name falls below ``held_out``."""
    side = lambda name: int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2 ** 64 < held_out
    train = [p for n, p in files.items() if not side(n)]
    held = [p for n, p in files.items() if side(n)]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def token_sequences(files: list[Path], encode, seq_len: int, n_seqs: int, sep: int | None = None) -> torch.Tensor:
    """The first ``n_seqs`` sequences [n_seqs, seq_len] (int64) of the files' tokens, concatenated in
    order (``sep`` after each file when given) and cut into whole sequences. Reads only what it needs."""
    need, parts, have = seq_len * n_seqs, [], 0
    tail = [] if sep is None else [sep]
    for f in files:
        if have >= need:
            break
        parts.append(np.asarray(encode(f.read_text(encoding="utf-8", errors="replace")) + tail, dtype=np.int64))
        have += len(parts[-1])
    if have < need:
        raise ValueError(f"the corpus has {have:,} tokens in {len(files)} files; {n_seqs} sequences of "
                         f"{seq_len} need {need:,}: ask for fewer steps / sequences or add corpus roots")
    return torch.from_numpy(np.concatenate(parts)[:need]).view(n_seqs, seq_len)
