"""matplotlib is optional (the `plot` extra): tools write their data first and draw only when it is installed."""

from __future__ import annotations

SKIPPED = "plot skipped: matplotlib is not installed (pip install 'extproc[plot]')"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
