"""One run top to bottom: plan, the runs it starts from, checks, folder life, assembly, the epoch loop."""
