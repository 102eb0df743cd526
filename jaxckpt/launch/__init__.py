"""The local launcher: N processes as one `jax.distributed` job, with failure injection.

`python -m jaxckpt.launch -n 4 --kill 2@7 -- python examples/lm.py ...` (see `_launcher`).
"""

from jaxckpt.launch._launcher import main as main

__all__ = ["main"]
