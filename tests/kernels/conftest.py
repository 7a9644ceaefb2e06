"""Kernel tests: on CUDA when there is a GPU, else on CPU under the Triton interpreter.

The top-level conftest sets TRITON_INTERPRET=1 on machines without CUDA, before any kernel
module is imported.
"""
import pytest
import torch

from kernels import reference
from kernels.formats import PAGE_TOKENS, PageFormat

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BIG_BYTES = 2**31 + 2**20  # a pool whose last pages start past 2^31 bytes


@pytest.fixture(scope="session", autouse=True)
def _interpreter_active():
    """Fail early, with the cause, if kernels were jitted for a GPU on a machine without one."""
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        from kernels import store
        if not isinstance(store._store_kernel, InterpretedFunction):
            pytest.exit("kernels were imported before TRITON_INTERPRET=1 was set; set it in the "
                        "environment (or in the top-level conftest) on machines without CUDA", 2)


def _random_rows(n: int, fmt: PageFormat, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(n, fmt.n_kv_heads, fmt.head_dim, generator=gen)
    return x * scale * (0.5 + torch.rand(n, 1, 1, generator=gen))  # row scales vary


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def make_rows(gen):
    """make_rows(n, fmt, scale=1.0) -> random float32 rows [n, H, D] on the CPU (never zeros)."""
    return lambda n, fmt, scale=1.0: _random_rows(n, fmt, gen, scale)


@pytest.fixture
def make_pool(gen):
    """make_pool(fmt, n_pages) -> pool on DEVICE whose every page holds random rows, stored by
    the reference."""
    def make(fmt: PageFormat, n_pages: int) -> torch.Tensor:
        pool = torch.empty(n_pages, fmt.page_bytes, dtype=torch.uint8)
        rows = _random_rows(n_pages * PAGE_TOKENS, fmt, gen)
        reference.store(pool, rows, torch.arange(n_pages * PAGE_TOKENS), fmt)
        return pool.to(DEVICE)
    return make


@pytest.fixture(scope="session")
def big_storage():
    """uint8 [BIG_BYTES] on DEVICE, allocated once: pools viewed into it have pages past 2^31."""
    try:
        return torch.empty(BIG_BYTES, dtype=torch.uint8, device=DEVICE)
    except (RuntimeError, MemoryError) as e:  # pragma: no cover - small CI machines
        pytest.skip(f"cannot allocate {BIG_BYTES / 2**30:.1f} GiB: {e}")


@pytest.fixture
def big_pool(big_storage):
    """big_pool(fmt) -> (pool view over big_storage, ids of its pages at or past 2^31 bytes,
    plus the page that straddles 2^31)."""
    def make(fmt: PageFormat):
        n = big_storage.numel() // fmt.page_bytes
        first = -(-(2**31) // fmt.page_bytes)
        return big_storage[: n * fmt.page_bytes].view(n, fmt.page_bytes), list(range(first - 1, n))
    return make
