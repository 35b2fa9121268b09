"""The opt-in NVIDIA DALI training input (data.backend=dali): JPEG/PNG decoding, crop, flip and RandAugment on the
GPU (nvJPEG, `mixed` decoder and `gpu` ops) when there is one, DALI's CPU operators otherwise.

DALI gets the project's own sampler order (the repeated-augmentation sampler: copies on different ranks, the
epoch cut to the dataset's size, per-epoch reseeding, a shard per rank) through an external source of file
bytes, and hands the trainer the batch the PIL path hands it: B x H x W x 3 uint8 pixels (on the GPU here) and
int64 labels. Normalization, random erasing and Mixup/CutMix stay per batch in the trainer (data/batch.py).
A pipeline is built per epoch, its seed drawn from the loader's `generator`, which run.py seeds per epoch and rank
(streams.py), so the ranks augment differently and a run resumed at an epoch boundary draws the same augmentations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Sampler

from deit_ablate.config.schema import AugmentConfig, DataConfig, DataName
from deit_ablate.core.distributed import choose_device
from deit_ablate.core.errors import ConfigError

if TYPE_CHECKING:
    from deit_ablate.data.transforms import TransformSpec

DALI_PACKAGE = "nvidia-dali-cuda130"


def require_dali() -> None:
    """Import DALI, or raise a ConfigError naming the package and how to install it."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"data.backend=dali needs NVIDIA DALI, which cannot be imported here ({error}). Install it with "
            f"`bash scripts/install.sh` (it installs {DALI_PACKAGE}) or `.venv/bin/python -m pip install "
            f"{DALI_PACKAGE}` (nvidia-dali-cuda120 for CUDA 12 drivers), or set data.backend=pil."
        ) from None


def dali_config_problem(data: DataConfig, aug: AugmentConfig) -> str | None:
    """What of these data and augment settings the DALI backend cannot run, with the fix, or None."""
    from deit_ablate.data.dali_augment import parse_rand_augment

    if data.name == DataName.cifar100:
        return ("data=cifar100 is held in memory as arrays; the DALI backend reads image files. Use "
                "data.backend=pil for CIFAR-100, or an ImageFolder tree (data=imagefolder).")
    if data.fast_jpeg:
        return "data.fast_jpeg speeds up the pil backend's crop; set data.fast_jpeg=false with data.backend=dali."
    if aug.no_aug:
        return "augment.no_aug=true (resize and center crop) is built for the pil backend only; set data.backend=pil."
    if not aug.auto_augment:
        return (f"the DALI backend builds timm's RandAugment only, not colour jitter (augment.color_jitter="
                f"{aug.color_jitter}, which timm applies when augment.auto_augment is off, as in the no_randaugment "
                "row); run this row with data.backend=pil.")
    spec = parse_rand_augment(aug.auto_augment)
    if isinstance(spec, str):
        return f"augment.auto_augment={aug.auto_augment}: {spec}; run it with data.backend=pil."
    if aug.interpolation not in ("bicubic", "bilinear"):
        return f"augment.interpolation={aug.interpolation}: the DALI backend resizes bicubic or bilinear."
    return None


def check_dali_config(data: DataConfig, augment: AugmentConfig) -> None:
    """Raise a ConfigError before anything runs when data.backend=dali cannot run these data and augment settings."""
    require_dali()
    problem = dali_config_problem(data, augment)
    if problem:
        raise ConfigError(f"data.backend=dali: {problem}")


class _EpochBatches:
    """One epoch's batches of (encoded file bytes, labels) in the sampler's order, for DALI's external source."""

    def __init__(self, samples: Sequence[tuple[str, int]], indices: list[int], batch_size: int) -> None:
        self.samples, self.indices, self.batch_size = samples, indices, batch_size

    def __iter__(self) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
        for start in range(0, len(self.indices) - self.batch_size + 1, self.batch_size):
            chunk = [self.samples[i] for i in self.indices[start:start + self.batch_size]]
            yield ([np.fromfile(path, dtype=np.uint8) for path, _ in chunk],
                   [np.array(label, dtype=np.int64) for _, label in chunk])


def fill_value(mean: Sequence[float]) -> int:
    """The one grey DALI's warps fill with: the mean of timm's fill colour (the dataset mean in 0-255)."""
    return int(round(float(np.mean([round(255 * m) for m in mean]))))


def dali_device_id(device: torch.device, current_device: Callable[[], int] = torch.cuda.current_device) -> int | None:
    """DALI's device_id for `device`: its GPU's index (the current GPU's for a bare "cuda"); None: DALI's CPU
    operators."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else current_device()


def copy_target(device_id: int | None,
                current_stream: Callable[[torch.device], Any] = torch.cuda.current_stream) -> tuple[torch.device, Any]:
    """Where DALI's batches are copied to: GPU `device_id` on its current stream, or the CPU (no stream)."""
    if device_id is None:
        return torch.device("cpu"), None
    device = torch.device("cuda", device_id)
    return device, current_stream(device)


class DaliTrainLoader:
    """The training loader of data.backend=dali: iterates (uint8 B x H x W x 3 images, labels) like a DataLoader."""

    def __init__(self, dataset, sampler: Sampler, batch_size: int, spec: TransformSpec,
                 device: torch.device | None = None, threads: int = 1) -> None:
        """DALI's loader over `dataset` in `sampler`'s order, augmenting as `spec` says, on `device`."""
        from deit_ablate.data.dali_augment import parse_rand_augment

        require_dali()
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.device_id = dali_device_id(device or choose_device("auto", local_rank=0))
        self.threads = threads  # DALI's CPU threads: data.loader gives it the loader workers' count
        aug = spec.augment
        self.graph = {"size": spec.resolution.train_size, "scale": tuple(aug.scale), "ratio": (3 / 4, 4 / 3),
                      "hflip": aug.hflip, "rand_spec": parse_rand_augment(aug.auto_augment),
                      "fill_value": fill_value(spec.data.mean), "interpolation": aug.interpolation,
                      "gpu": self.device_id is not None}  # the mixed decoder and GPU operators
        self.generator: torch.Generator | None = None  # set per epoch by loader.seed_epoch_data

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def build_pipeline(self, indices: list[int], seed: int):
        """A DALI pipeline that yields this epoch's batches, then stops."""
        from nvidia.dali import fn, pipeline_def, types

        from deit_ablate.data.dali_augment import deit_train_images

        source = _EpochBatches(self.dataset.samples, indices, self.batch_size)

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=self.device_id, seed=seed,
                      enable_conditionals=True, prefetch_queue_depth=2)
        def pipeline():
            encoded, labels = fn.external_source(source=source, num_outputs=2, dtype=[types.UINT8, types.INT64])
            return deit_train_images(encoded, **self.graph), labels

        pipe = pipeline()
        pipe.build()
        return pipe

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        indices = [int(i) for i in self.sampler]
        seed = int(torch.randint(0, 2**31 - 1, (), generator=self.generator).item())
        pipe = self.build_pipeline(indices, seed)
        size = self.graph["size"]
        device, stream = copy_target(self.device_id)
        try:
            for index in range(len(indices) // self.batch_size):
                try:
                    images, labels = pipe.run()
                except RuntimeError as error:
                    raise ConfigError(_decode_error_text(self.dataset.samples, indices, self.batch_size, index,
                                                         error)) from None
                batch = torch.empty((self.batch_size, size, size, 3), dtype=torch.uint8, device=device)
                feed_ndarray(images.as_tensor(), batch, cuda_stream=stream)
                yield batch, torch.from_numpy(np.array(labels.as_tensor()).reshape(-1))
        finally:
            del pipe


def _unreadable(samples: Sequence[tuple[str, int]], indices: list[int]) -> tuple[str, str] | None:
    from deit_ablate.data.bad_images import decode_problem

    for i in indices:
        problem = decode_problem(samples[i][0])
        if problem:
            return samples[i][0], problem
    return None


def _decode_error_text(samples, indices: list[int], batch_size: int, index: int, error: Exception) -> str:
    """The clear stop when DALI cannot decode a batch: the unreadable file among the batches in flight, if PIL
    finds it too, and the fix (data.backend=dali has no runtime.on_bad_image=skip)."""
    in_flight = indices[index * batch_size:(index + 3) * batch_size]  # this batch and the two DALI prefetched
    found = _unreadable(samples, in_flight)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    what = f"{found[0]} cannot be read as an image ({found[1]})" if found else \
        f"DALI could not decode a training image ({first_line})"
    return (f"{what}; data.backend=dali stops at an unreadable image (it has no runtime.on_bad_image=skip). "
            "Replace or delete the file, or train with data.backend=pil, which puts the next readable image in "
            "its place.")


def dali_available() -> bool:
    """Whether DALI imports here (tests and benchmarks that need it)."""
    try:
        require_dali()
    except ConfigError:
        return False
    return True
