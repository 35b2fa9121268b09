"""One self-contained HTML page: the table with the paper beside it, and the plots embedded as PNG data URIs.

Nothing is loaded from elsewhere (no scripts, style sheets, fonts or images by URL), so the file opens
offline and can be mailed to people who do not use wandb. The heading holds the study's title (once) and what
our runs are; a block under the caption says what was run (data, model, epochs, resolution, preset, commit,
the aggregator's filters), and the footer repeats the commit and filters. No Markdown markup leaks in.
"""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from html import escape

from .about import facts, headline, page_title
from .cells import Table
from .columns import caption, footnotes, headers, row_cells

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2em;
       color: #222; max-width: 1400px; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.3em 0.7em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
thead th { border-bottom: 2px solid #444; }
tr.sub td:first-child { padding-left: 1.6em; color: #555; }
tr.empty td { color: #999; }
p.note { font-size: 0.85em; color: #444; max-width: 1100px; }
table.about { font-size: 0.85em; margin: 0.6em 0 1.2em; }
table.about th, table.about td { text-align: left; white-space: normal; border-bottom: 1px solid #eee; }
footer { font-size: 0.8em; color: #555; margin-top: 2em; border-top: 1px solid #ddd; padding-top: 0.5em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
div.wide { overflow-x: auto; max-width: 100%; }
"""


def png_uri(data: bytes) -> str:
    """PNG bytes as a `data:` URI."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _row_html(table: Table, digits: int) -> list[str]:
    lines = []
    for row in table.rows:
        classes = [c for c, on in (("sub", row.base and row.key != row.base), ("empty", not row.has_runs)) if on]
        attr = f' class="{" ".join(classes)}"' if classes else ""
        cells = "".join(f"<td>{escape(text)}</td>" for text in row_cells(table, row, digits))
        lines.append(f"<tr{attr}>{cells}</tr>")
    return lines


def _about_html(table: Table) -> list[str]:
    """What was run, one line per fact."""
    rows = "".join(f"<tr><th>{escape(label)}</th><td>{escape(text)}</td></tr>" for label, text in facts(table))
    return ['<table class="about"><caption>What was run</caption>', rows, "</table>"]


def _footer(table: Table) -> str:
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    known = dict(facts(table))
    extra = "".join(f"; {k}: {known[k]}" for k in ("commit", "filters") if k in known)
    return f"<footer>Made by deit-aggregate on {made}{escape(extra)}.</footer>"


def to_html(table: Table, digits: int = 2, images: list[tuple[str, bytes]] | None = None) -> str:
    """The table, its notes and the given (title, PNG) images as one HTML document."""
    heads = "".join(f"<th>{escape(h)}</th>" for h in headers(table))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(page_title(table))}</title>",
        f"<style>{STYLE}</style>",
        "</head><body>",
        f"<h1>{escape(headline(table))}</h1>",
        f"<p>{escape(caption(table, markdown=False))}</p>",
        *_about_html(table),
        f'<div class="wide"><table><thead><tr>{heads}</tr></thead><tbody>',  # wider than the page: it scrolls
        *_row_html(table, digits),
        "</tbody></table></div>",
        *(f'<p class="note">{escape(note)}</p>' for note in footnotes(table)),
    ]
    for name, data in images or []:
        parts += [f"<h2>{escape(name)}</h2>", f'<img alt="{escape(name)}" src="{png_uri(data)}">']
    parts += [_footer(table), "</body></html>"]
    return "\n".join(parts) + "\n"
