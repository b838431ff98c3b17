"""Shared fixtures: float64 on demand and fast compiles, restored afterwards."""

import gc

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


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# Half the kernel's limit: a test compiles far fewer programs than that.
_MAPPINGS_MAX = _map_limit() // 2
# Mappings left after the last release: the next one waits until this many more.
_released_at = [0]


def _mappings() -> int:
    """The memory mappings this process holds (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs_when_many():
    """The same within a module: drop JAX's caches after a test that leaves the process
    holding more than half of `vm.max_map_count` mappings (and a quarter of it more
    than after the last release, so that mappings the caches do not hold cannot make every
    later test recompile). One worker running many of the slow cases of a large module
    (the ODE methods times the adjoints) reached the limit, and XLA's compiler then
    crashed with a segmentation fault."""
    yield
    count = _mappings()
    if count > max(_MAPPINGS_MAX, _released_at[0] + _MAPPINGS_MAX // 2):
        gc.collect()
        jax.clear_caches()
        _released_at[0] = _mappings()
