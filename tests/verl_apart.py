"""verl on the import path: ``make test`` installs it apart (``.venv/verl``), without its dependencies (it pins
transformers and tensordict below ours) and away from site-packages (its wheel ships top-level ``tests`` and
``scripts`` packages), so it is appended, never ahead of anything."""

import sys
from pathlib import Path

APART = Path(sys.prefix) / "verl"
if APART.is_dir() and str(APART) not in sys.path:
    sys.path.append(str(APART))
