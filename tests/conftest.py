"""Shared fixtures: tiny GGUF models written per session, the real models when installed."""

from __future__ import annotations

import os

import pytest
import torch

# Kernels run under the Triton interpreter on machines without CUDA. It must be set before any
# @triton.jit function is defined, i.e. before anything imports kernels.*: this file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstream.model import registry


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def real_model_path(name: str):
    """Path of a registered real model, or skip the test when its extra is not installed."""
    try:
        return registry.resolve_model(name)
    except registry.ModelNotAvailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def qwen05_path():
    return real_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path():
    return real_model_path("qwen2.5-coder-1.5b")
