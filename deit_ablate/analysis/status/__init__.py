"""`deit-status`: where every run of a sweep stands, from its run folder (result.json, progress.json, run.lock,
checkpoints), the dry run's plan (run/lifecycle.py's launch_action) and SLURM's queue where there is one.

    cli.py      the command: an output root or a sweep's overrides; --watch, --json
    sweep.py    a sweep's runs composed and planned as the dry run plans them
    rows.py     one row per run: its state (STATES) and numbers
    slurm.py    squeue/sacct, with a short timeout; nothing where they do not exist
    view.py     the rich table, the totals and the JSON
"""
