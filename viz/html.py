"""Writing a chart as an HTML page, with plotly.js inline (default) or from the CDN.

Inline pages open offline, which is why it is the default, but each carries ~4.8 MB of
plotly.js; ``cdn`` writes a page of a few kB that loads plotly.js from
cdn.plot.ly when opened (the network is needed to view it).
"""

from __future__ import annotations

PLOTLY_MODES = ("inline", "cdn")


MISSING_PLOTLY = (
    "<div id='pipesim-no-plotly' style='display:none;padding:12px;margin:12px;border:2px solid #C0392B;"
    "font:15px sans-serif'>This chart loads plotly.js from cdn.plot.ly (it was written with <code>--plotly "
    "cdn</code>), and the page could not reach it: open it with a network connection, or write it again with "
    "<code>--plotly inline</code> to view it offline.</div>"
)
CHECK_PLOTLY = ("<script>if (typeof Plotly === 'undefined') "
                "{document.getElementById('pipesim-no-plotly').style.display = 'block';}</script>")


def with_offline_notice(html: str, plotly: str) -> str:
    """A ``cdn`` page that says why it is blank when plotly.js cannot be loaded (offline),
    instead of showing nothing; an inline page as it is."""
    if plotly != "cdn":
        return html
    return html.replace("<body>", "<body>" + MISSING_PLOTLY, 1).replace("</body>", CHECK_PLOTLY + "</body>", 1)


def include_plotlyjs(plotly: str) -> bool | str:
    """plotly's ``include_plotlyjs`` argument for ``inline`` or ``cdn``."""
    if plotly not in PLOTLY_MODES:
        raise ValueError(f"plotly must be one of {', '.join(PLOTLY_MODES)}, got {plotly!r}")
    return True if plotly == "inline" else "cdn"

