"""Shared fixtures: async tests run on asyncio and trio via the AnyIO plugin."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
