"""Model registry: assembling a GGUF from part packages, verification and its errors."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvstream.model import registry


def make_parts(tmp_path, monkeypatch, chunks: list[bytes], prefix="fakepart") -> list[str]:
    """Install importable part packages exposing get_part_path(), like the real model extras."""
    names = []
    for i, data in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
        names.append(pkg.name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return names


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    chunks = [os.urandom(1000), os.urandom(1000), os.urandom(17)]
    whole = b"".join(chunks)
    model = registry.RegisteredModel("fake-model", "fake.gguf", tuple(make_parts(tmp_path, monkeypatch, chunks)),
                                     len(whole), hashlib.sha256(whole).hexdigest(), "fake-extra")
    monkeypatch.setitem(registry.MODELS, model.name, model)
    monkeypatch.setenv("KVSTREAM_CACHE", str(tmp_path / "cache"))
    return model, whole


def test_assembles_parts_in_order_into_the_cache_folder(fake_model, tmp_path):
    model, whole = fake_model
    path = registry.resolve_model("fake-model")
    assert path == tmp_path / "cache" / "fake.gguf"
    assert path.read_bytes() == whole
    assert registry.resolve_model("fake-model") == path  # second call reuses the file
    assert registry.is_available("fake-model")


def test_corrupt_parts_are_rejected_and_leave_nothing(fake_model, monkeypatch, tmp_path):
    model, _ = fake_model
    monkeypatch.setitem(registry.MODELS, model.name,
                        registry.RegisteredModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(RuntimeError, match=r"corrupt.*expected 2017 bytes, sha256 0000"):
        registry.resolve_model("fake-model")
    assert not any((tmp_path / "cache").iterdir())


def test_missing_packages_name_the_extra(monkeypatch):
    model = registry.RegisteredModel("absent-model", "absent.gguf", ("no_such_part_pkg_1",), 1, "0" * 64, "absent-x")
    monkeypatch.setitem(registry.MODELS, model.name, model)
    with pytest.raises(registry.ModelNotAvailable, match=r"no_such_part_pkg_1.*pip install 'kvstream\[absent-x\]'"):
        registry.resolve_model("absent-model")
    assert not registry.is_available("absent-model")


def test_any_path_is_a_model_and_unknown_names_are_clear(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert registry.resolve_model(str(f)) == f
    with pytest.raises(FileNotFoundError, match=r"qwen2\.5-coder-0\.5b, qwen2\.5-coder-1\.5b"):
        registry.resolve_model("qwen-nonexistent")


def test_registered_models_name_their_extras():
    assert registry.MODELS["qwen2.5-coder-0.5b"].extra == "qwen-coder-0-5b"
    assert registry.MODELS["qwen2.5-coder-1.5b"].extra == "qwen-coder-1-5b"
    assert len(registry.MODELS["qwen2.5-coder-1.5b"].part_modules) == 22
