"""Shared fixtures: float64 on demand and fast compiles, restored afterwards."""

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


@pytest.fixture(scope="module")
def fast_compiles():
    """For modules that compile many small XLA programs and run each once: skip XLA's
    expensive optimisation passes (the derivative rules under test do not depend on them).
    Use with `pytestmark = pytest.mark.usefixtures("fast_compiles")`."""
    old = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's caches of compiled programs after each test module.

    Every compiled XLA:CPU program keeps memory mappings alive; the whole suite compiles
    thousands of them, and past the kernel's limit on mappings per process
    (`vm.max_map_count`, 65530 by default) the compiler's allocations fail and the
    process crashes. Nothing is shared between modules, so the caches can go.
    """
    yield
    jax.clear_caches()
