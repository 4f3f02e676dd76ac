"""`python -m kvfence_devcluster`: the `kvfence-devcluster` command."""

import sys

from .cli import main

sys.exit(main())
