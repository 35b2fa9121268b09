"""What a run reports when it ends: its summary (result.json, the wandb summary) and the lines a person reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deit_ablate.core.logs import log


def summarize(status: str, metrics: dict, ema_metrics: dict, best_top1: float, epochs_done: int, step: int,
              seconds: float) -> dict[str, Any]:
    """The run's summary: headline top-1 (EMA's when EMA is on), best and final values, status, the epochs
    completed, the optimizer steps and the training seconds of all its launches together."""
    final = {"status": status, "epochs_done": epochs_done, "steps_done": step,
             "train_seconds": round(seconds, 1)}
    if metrics:
        final.update(top1_final=metrics["top1"], top5_final=metrics["top5"], val_loss_final=metrics["loss"])
        if "top1_cls" in metrics:  # a model with a distillation token: both heads and both fusion rules
            final.update(top1_cls=metrics["top1_cls"], top1_dist=metrics["top1_dist"], top1_fused=metrics["top1"],
                         top1_fused_alt=metrics["top1_fused_alt"])
        if "high_norm_tokens" in metrics:  # a ViT: its share of high-norm patch tokens (deit_ablate.train.artifacts)
            final["high_norm_tokens"] = metrics["high_norm_tokens"]
    if ema_metrics:
        final.update(top1_ema_final=ema_metrics["top1"], top5_ema_final=ema_metrics["top5"],
                     top1_ema_best=best_top1)
    headline = ema_metrics.get("top1", metrics.get("top1"))
    if headline is not None:
        final["top1"] = headline
        final["top1_best"] = best_top1
    return final


def fusion_figures(final: dict[str, Any], rule: str) -> dict[str, Any]:
    """A distilled model's top-1 under each fusion rule by name (`top1_fusion_prob`: the DeiT paper's softmax sum,
    `top1_fusion_logit`: the released code's and timm's logit mean) and the rule its top1_fused ranks by."""
    other = "logit" if rule == "prob" else "prob"
    return {"fusion": rule, f"top1_fusion_{rule}": final["top1_fused"], f"top1_fusion_{other}": final["top1_fused_alt"]}


def wandb_summary(final: dict[str, Any]) -> dict[str, Any]:
    """The run's summary as wandb keeps it: result.json's `sharpness` record as its three figures
    (`sharpness/lambda_max`, ...), its settings left to result.json."""
    from deit_ablate.train.sharpness import summary_values

    summary = {k: v for k, v in final.items() if k != "sharpness"}
    return {**summary, **summary_values(final["sharpness"])} if "sharpness" in final else summary


def accuracy_line(final: dict[str, Any]) -> str:
    """The summary's accuracy line, each figure labelled with whose it is: the EMA's (the headline when a run keeps
    one) with the model's beside it, or the model's alone."""
    if "top1_ema_final" not in final:
        top5 = f"   top-5 {final['top5_final']:.2f}%" if "top5_final" in final else ""
        return f"top-1     model {final['top1']:.2f}% final, {final['top1_best']:.2f}% best{top5}"
    model = final.get("top1_final")
    return (f"top-1     EMA {final['top1']:.2f}% final, {final['top1_best']:.2f}% best"
            + (f"; model {model:.2f}% final" if model is not None else "")
            + f"   top-5 EMA {final['top5_ema_final']:.2f}%"
            + (f", model {final['top5_final']:.2f}%" if "top5_final" in final else ""))


def print_summary(name: str, run_id: str, final: dict[str, Any], run_dir: Path) -> None:
    """A few lines a person reads at the end of a run (on the console and in train.log)."""
    lines = ["", "=" * 72, f"run       {name}  (wandb id {run_id})",
             f"status    {final['status']} after {final['steps_done']} steps, {final['train_seconds']:.0f}s"]
    if "top1" in final:
        lines.append(accuracy_line(final))
    if "top1_cls" in final:
        lines.append(f"heads     class {final['top1_cls']:.2f}%  distillation {final['top1_dist']:.2f}%  "
                     f"fused {final['top1_fused']:.2f}% (other rule {final['top1_fused_alt']:.2f}%)")
    if "sharpness" in final:
        sharp = final["sharpness"]
        lines.append(f"sharpness lambda_max {sharp['lambda_max']:.4g}, train loss {sharp['train_loss']:.4f}, noisy "
                     f"loss {sharp['noisy_loss']:.4f} (sigma {sharp['settings']['sigma']:g})")
    if "amp_skipped_steps" in final:
        lines.append(f"fp16      {final['amp_skipped_steps']} optimizer step(s) skipped by the loss scaler")
    if final.get("data/bad_images"):
        lines.append(f"data      {final['data/bad_images']} unreadable image(s) replaced (named in train.log)")
    lines += [f"outputs   {run_dir}", "=" * 72]
    log.info("\n".join(lines))
