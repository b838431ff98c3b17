"""Shared fixtures: float64 on demand, restored afterwards."""

import jax
import pytest


@pytest.fixture
def x64():
    """Run a test with 64-bit floats enabled, restoring the previous setting afterwards."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)
