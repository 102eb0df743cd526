"""`python -m jaxckpt.bench`."""

import sys

from jaxckpt.bench._run import main

sys.exit(main())
