"""Test setup: 8 fake CPU devices in this process, before anything touches jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import patience
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Stretches the test's hang timeout (pytest-timeout) with the machine's load now."""
    marker = item.get_closest_marker("timeout")
    base = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    if base:
        item.add_marker(pytest.mark.timeout(float(base) * patience.stretch()), append=False)
    yield


@pytest.fixture
def memory_root(tmp_path):
    """A memory root for one test (tmp_path is enough: the tier only needs a directory)."""
    return str(tmp_path / "memory")


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"
