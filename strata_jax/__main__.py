"""`python -m strata_jax`: the same as the `strata-jax` command."""

import sys

from strata_jax.cli import main

sys.exit(main())
