"""Turning the SGLang plug-in on and off: the one method it replaces, its restoration, the
version it requires, and what it says when SGLang's backend is missing."""

import sys
from importlib import metadata

import pytest

from tests.support.sglang_backend import skip_reason

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

import mlx_batched_decode.sglang as plugin  # noqa: E402

PREFIX = r"^\[mlx_batched_decode\.sglang\] "


def _method(backend):
    return backend.attention_wrapper.MLXAttentionWrapper.__dict__["_batched_decode"]


def test_disable_restores_the_method(backend):
    original = _method(backend)
    plugin.enable()
    plugin.enable()  # idempotent: nothing patched twice
    assert plugin.is_enabled()
    patched = _method(backend)
    assert patched is not original and patched.__wrapped__ is original
    plugin.disable()
    plugin.disable()
    assert not plugin.is_enabled() and _method(backend) is original

    # The context manager turns it off after its block, also when the block raises...
    with pytest.raises(RuntimeError):
        with plugin.enabled():
            assert plugin.is_enabled() and _method(backend) is not original
            raise RuntimeError("inside")
    assert _method(backend) is original and not plugin.is_enabled()
    # ... but leaves it on when it was on before.
    plugin.enable()
    with plugin.enabled():
        pass
    assert plugin.is_enabled()
    plugin.disable()
    with pytest.raises(ValueError, match=PREFIX + r"stats\(\)"):
        plugin.stats()


def test_other_sglang_versions_are_refused(backend, monkeypatch):
    original = _method(backend)
    version = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "0.5.22" if name == "sglang" else version(name)
    )
    with pytest.raises(ValueError, match=PREFIX + r"needs sglang 0\.5\.23, .*found 0\.5\.22"):
        plugin.enable()
    assert not plugin.is_enabled() and _method(backend) is original


def test_missing_sglang_is_an_import_error(backend, monkeypatch):
    def version(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ModuleNotFoundError, match=PREFIX + r"needs sglang 0\.5\.23 installed"):
        plugin.enable()
    assert not plugin.is_enabled()


def test_a_backend_that_does_not_import_is_an_import_error(backend, monkeypatch):
    # What a machine where SGLang's packages do not import (no torch) gets from enable().
    monkeypatch.setitem(sys.modules, backend.attention_wrapper.__name__, None)
    with pytest.raises(ImportError, match=PREFIX + r"SGLang's MLX backend does not import here"):
        plugin.enable()
    assert not plugin.is_enabled()
