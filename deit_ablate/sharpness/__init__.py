"""Sharpness of a trained model: the measures (measure.py) and `python -m deit_ablate.sharpness <run>` (cli.py)."""

from deit_ablate.sharpness.measure import (
    FIGURES,
    BatchLoss,
    SharpnessSettings,
    figures_text,
    hessian_vector_product,
    measure,
    measure_weights,
    noisy_loss,
    summary_values,
    top_eigenvalue,
)

__all__ = ["FIGURES", "BatchLoss", "SharpnessSettings", "figures_text", "hessian_vector_product", "measure",
           "measure_weights", "noisy_loss", "summary_values", "top_eigenvalue"]
