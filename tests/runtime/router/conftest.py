"""The router's end-to-end tests start real replicas and routers with the server tests' harness."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
