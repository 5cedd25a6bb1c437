"""Writing a chart as an HTML page, with plotly.js inline (default) or from the CDN.

Inline pages open offline, which is why it is the default, but each carries ~4.8 MB of
plotly.js; ``cdn`` writes a page of a few kB that loads plotly.js from
cdn.plot.ly when opened (the network is needed to view it).
"""

from __future__ import annotations

PLOTLY_MODES = ("inline", "cdn")


def include_plotlyjs(plotly: str) -> bool | str:
    """plotly's ``include_plotlyjs`` argument for ``inline`` or ``cdn``."""
    if plotly not in PLOTLY_MODES:
        raise ValueError(f"plotly must be one of {', '.join(PLOTLY_MODES)}, got {plotly!r}")
    return True if plotly == "inline" else "cdn"

