"""The embedded model pair: its build (`build.py`), specs, weights and benchmarks."""

from pathlib import Path

WEIGHTS_DIR = Path(__file__).parent / "weights"  # the committed pair (target/, drafter/, traces.npz, build_report.json)
