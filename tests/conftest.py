"""Helpers for the integration tests: tests/ on sys.path for fakehub.py and doubles.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
