"""`python -m jaxckpt.launch`."""

import sys

from jaxckpt.launch._launcher import main

sys.exit(main())
