"""jaxckpt: checkpoint every step to host memory and peers; persist lazily with tensorstore."""

from jaxckpt._args import TieredRestore as TieredRestore
from jaxckpt._args import TieredSave as TieredSave
from jaxckpt._handler import TieredCheckpointHandler as TieredCheckpointHandler
from jaxckpt._manager_options import manager_options as manager_options
from jaxckpt._options import TierOptions as TierOptions
from jaxckpt._resume import latest_restorable_step as latest_restorable_step
from jaxckpt.format._format import JAXCKPT_VERSION as __version__
from jaxckpt.restore._existing import restore_existing as restore_existing
from jaxckpt.restore._export import export as export
from jaxckpt.tools._prometheus import PrometheusMetrics as PrometheusMetrics

__all__ = [
    "PrometheusMetrics",
    "TierOptions",
    "TieredCheckpointHandler",
    "TieredRestore",
    "TieredSave",
    "__version__",
    "export",
    "latest_restorable_step",
    "manager_options",
    "restore_existing",
]
