"""The shared API server of the server tests (`start_server`, in the conftest above, starts the others)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import ServerProcess

API_KEY = "test-key"


@pytest.fixture(scope="session")
def api_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The shared server: priority scheduling, an API key, and a small body limit to test against."""
    return start_server(
        "--scheduling-policy", "priority", "--max-request-body-bytes", "65536", api_key=API_KEY
    )
