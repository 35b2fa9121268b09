"""Throughput benchmarks: train step, input pipeline, end-to-end runs, startup; ours beside timm's train.py."""
