"""`python -m deit_ablate.disagreement RUN [RUN ...] [--out DIR]`: the pairwise disagreement matrix (DeiT Table 4)
of finished runs, from the predictions each keeps (predictions.npz), with the paper's values beside it.

Prints the matrix (percent of eval images on which two (run, head) predictions differ) and the paper's Table 4 as
markdown; with --out, writes disagreement.csv, disagreement.json, disagreement.md and disagreement.png (a heatmap)
there. Runs on different data, or with predictions of other images, are refused before anything is computed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deit_ablate.analysis.aggregate.disagree import (
    check_comparable,
    columns,
    disagreement_matrix,
    heatmap,
    load_predictions,
    markdown_matrix,
    markdown_reference,
    matrix_csv,
    missing_roles,
    paper_pairs,
    reference_rows,
    unique_labels,
)
from deit_ablate.core.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import RunDir, find_run, runs_root
from deit_ablate.run.commands import command


def resolve_run(reference: str) -> RunDir:
    """The run folder `reference` names (a folder, or a run name under outputs/runs); a ConfigError otherwise."""
    run = find_run(Path(reference), runs_root("outputs"))
    if run is None or not (run.result.exists() or run.hydra_config.exists()):
        raise ConfigError(f"{reference} is not a run folder: give the folder of a finished run, e.g. "
                          "outputs/runs/<run name>, or its name under outputs/runs.")
    return run


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(prog="python -m deit_ablate.disagreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="+", metavar="RUN", help="finished run folders (or names under outputs/runs)")
    parser.add_argument("--label", action="append", default=None,
                        help="a run's label in the matrix, one per RUN in order (default: its study row, "
                             "e.g. teachers=regnety_4gf)")
    parser.add_argument("--out", default=None, help="a folder for the CSV, JSON, markdown and heatmap PNG")
    return parser


def report(run_refs: list[str], labels: list[str] | None, out: str | None) -> str:
    """The matrix and the paper's values as markdown; written under `out` too when given."""
    if labels is not None and len(labels) != len(run_refs):
        raise ConfigError(f"{len(labels)} --label for {len(run_refs)} runs: give one --label per RUN, or none.")
    runs = [load_predictions(resolve_run(ref), labels[i] if labels else None) for i, ref in enumerate(run_refs)]
    check_comparable(runs)
    runs = unique_labels(runs)
    names, values = zip(*columns(runs), strict=True)
    matrix = disagreement_matrix(values)
    table = paper_pairs()
    reference = reference_rows(runs, table)
    why = missing_roles(runs)
    images = int(runs[0].index.size)
    text = (f"Disagreement between models over {images} eval images (percent of images predicted differently)\n\n"
            f"{markdown_matrix(names, matrix)}\n\n{markdown_reference(reference, table, why)}\n")
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / "disagreement.md", text)
        write_text_atomic(folder / "disagreement.csv", matrix_csv(names, matrix))
        write_json_atomic(folder / "disagreement.json", {
            "images": images, "labels": list(names), "runs": [r.run.name for r in runs],
            "percent": matrix.round(4).tolist(), "paper_table4": reference, "paper_missing": why})
        from deit_ablate.analysis.aggregate.plot import figure_png

        write_bytes_atomic(folder / "disagreement.png", figure_png(heatmap(names, matrix, reference, images, why)))
        text += f"\nwritten: {folder}/disagreement.{{md,csv,json,png}}\n"
    return text


@command("python -m deit_ablate.disagreement")
def main(argv: list[str] | None = None) -> int:
    """Print (and write) the matrix; 0 on success, 2 with one line on stderr for bad input."""
    args = build_parser().parse_args(argv)
    try:
        print(report(args.run, args.label, args.out), end="")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
