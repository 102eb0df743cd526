"""Test setup: 8 fake CPU devices in this process, before anything touches jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def memory_root(tmp_path):
    """A memory root for one test (tmp_path is enough: the tier only needs a directory)."""
    return str(tmp_path / "memory")


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"
