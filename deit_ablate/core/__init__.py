"""Plumbing every layer uses: errors, atomic writes, processes and ranks, random streams, signals, logs."""
