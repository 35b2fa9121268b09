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
h1 { font-size: 1.45em; line-height: 1.25; }
table.results { border-collapse: collapse; font-size: 0.9em; max-width: 100%; }
table.results th, table.results td { padding: 0.3em 0.6em; border-bottom: 1px solid #ddd; text-align: right;
                                     vertical-align: top; }
table.results th:first-child, table.results td:first-child { text-align: left; overflow-wrap: anywhere; }
table.results thead th { border-bottom: 2px solid #444; vertical-align: bottom; }
tr.sub td:first-child { padding-left: 1.6em; color: #555; }
tr.empty td { color: #999; }
p.note { font-size: 0.85em; color: #444; max-width: 1100px; }
table.about { font-size: 0.85em; margin: 0.6em 0 1.2em; border-collapse: collapse; }
table.about th, table.about td { text-align: left; padding: 0.2em 0.7em; border-bottom: 1px solid #eee; }
footer { font-size: 0.8em; color: #555; margin-top: 2em; border-top: 1px solid #ddd; padding-top: 0.5em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
@media (max-width: 1200px) { body { margin: 1em; } table.results { font-size: 0.8em; }
                             table.results th, table.results td { padding: 0.25em 0.4em; } }
"""


def png_uri(data: bytes) -> str:
    """PNG bytes as a `data:` URI."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def breakable(text: str) -> str:
    """Escaped text that may wrap after an underscore (`teach_function_matching_9600`) where a column is narrow."""
    return escape(text).replace("_", "_<wbr>")


def _row_html(table: Table, digits: int) -> list[str]:
    lines = []
    for row in table.rows:
        classes = [c for c, on in (("sub", row.base and row.key != row.base), ("empty", not row.has_runs)) if on]
        attr = f' class="{" ".join(classes)}"' if classes else ""
        cells = "".join(f"<td>{breakable(text)}</td>" for text in row_cells(table, row, digits))
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
    heads = "".join(f"<th>{breakable(h)}</th>" for h in headers(table))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(page_title(table))}</title>",
        f"<style>{STYLE}</style>",
        "</head><body>",
        f"<h1>{escape(headline(table))}</h1>",
        f"<p>{escape(caption(table, markdown=False))}</p>",
        *_about_html(table),
        f'<table class="results"><thead><tr>{heads}</tr></thead><tbody>',  # cells wrap: no column is cut off
        *_row_html(table, digits),
        "</tbody></table>",
        *(f'<p class="note">{escape(note)}</p>' for note in footnotes(table)),
    ]
    for name, data in images or []:
        parts += [f"<h2>{escape(name)}</h2>", f'<img alt="{escape(name)}" src="{png_uri(data)}">']
    parts += [_footer(table), "</body></html>"]
    return "\n".join(parts) + "\n"
