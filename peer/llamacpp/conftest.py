# Adapted for structllm from ggml-org/llama.cpp tools/server/tests/conftest.py
# (commit ac18090e240036cc0dfc88b4538e38240f965d9f), MIT licence
# (peer/llamacpp/LICENSE). structllm: servers are pooled by their flags
# (peer/llamacpp/utils.py) and stopped once the session ends, not after each
# test; ServerPreset.load_all (a model download) is gone: tiny is built in.

from collections.abc import Iterator

import pytest

from peer.llamacpp.utils import ServerPreset, close_pool


@pytest.fixture(scope="session", autouse=True)
def stop_servers_after_session() -> Iterator[None]:
    yield
    close_pool()


@pytest.fixture
def server_factory():
    """Factory: returns a fresh, configured (but not started) ServerProcess."""

    def _build(preset="tinyllama2", **overrides):
        s = getattr(ServerPreset, preset)()
        for k, v in overrides.items():
            setattr(s, k, v)
        return s

    return _build
