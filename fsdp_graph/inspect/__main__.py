"""`python -m fsdp_graph.inspect DIR`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
