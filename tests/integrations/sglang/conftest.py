"""Fixtures of the SGLang plug-in's tests: SGLang's backend modules, the plug-in turned off
around every test, and counters of the calls a decode step makes."""

import pytest

import mlx_batched_decode.sglang as plugin


@pytest.fixture(scope="session")
def backend():
    from tests.support.sglang_backend import load_backend

    return load_backend()


@pytest.fixture(autouse=True)
def plugin_off():
    """Every test starts and ends with the plug-in off, whatever happens inside."""
    plugin.disable()
    yield
    plugin.disable()


class DecodeCalls:
    """Calls of one function made inside decode steps, i.e. while SGLang's
    ``BatchedDecodeContext`` is set (prefill runs without one)."""

    def __init__(self, monkeypatch, backend, owner, name):
        self.count = 0
        original = getattr(owner, name)
        get_context = backend.attention_wrapper.get_context

        def counting(*args, **kwargs):
            if get_context() is not None:
                self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)


@pytest.fixture
def decode_calls(monkeypatch, backend):
    """``decode_calls(owner, name)`` starts counting ``owner.name``'s calls in decode steps."""
    return lambda owner, name: DecodeCalls(monkeypatch, backend, owner, name)
