"""The local launcher: N processes as one `jax.distributed` job, with failure injection.

`python -m jaxckpt.launch -n 4 --kill 2@7 -- python examples/lm.py ...` (see `_launcher`).
`parse_event` reads the JSON event lines (`step`, `restored`) a launched job prints.
"""

from jaxckpt.launch._launcher import main as main
from jaxckpt.launch._launcher import parse_event as parse_event

__all__ = ["main", "parse_event"]
