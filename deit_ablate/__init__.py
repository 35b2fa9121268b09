"""deit-ablate: re-run the DeiT recipe and its ablation (Touvron et al. 2021, Table 8)."""

__version__ = "0.1.0"
