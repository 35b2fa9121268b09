"""The aggregator: read wandb runs (offline logs or the W&B API) and rebuild the ablation table.

`reader` turns logs into `RunInfo`, `select` filters and de-duplicates, `settings` says which runs are the
same experiment (one cell), `table` groups rows and stages, `stats` gives each Δ its interval over seeds,
`paper` holds the paper's numbers, `about` says what was run, `render`, `html`, `plot` and `curves` write the
result, `cli` ties them together.
"""

from .cells import Table
from .paper import PaperTable, paper_table
from .reader import RunInfo, read_api, read_offline, read_run_file
from .select import RunFilter, dedup
from .table import build_table

__all__ = [
    "PaperTable",
    "RunFilter",
    "RunInfo",
    "Table",
    "build_table",
    "dedup",
    "paper_table",
    "read_api",
    "read_offline",
    "read_run_file",
]
