"""The GPU check's code on the CPU: every function scripts/gpu_check.sh calls, at 224 px with a narrow DeiT (patch 16,
one block of width 48), on uint8 B x H x W x 3 batches as the loader yields them.

Where a function makes a CUDA call, bench.env.DeviceCalls holds that one call; these tests run the code around it with
the CPU's equivalents (cpu_calls: HostReads for the sync debug mode) or, where a test says so, a stand-in for that one
call (a peak-memory figure, a GPU's name), so no line of the check is reached only on a GPU."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import timm
import torch

from deit_ablate.analysis.sharpness import build_parser as build_sharpness_parser
from deit_ablate.bench import step
from deit_ablate.bench.env import (
    DeviceCalls,
    cpu_calls,
    cuda_calls,
    describe,
    device_calls,
    matmul_rate,
    matmul_setting,
)
from deit_ablate.bench.gpu_check import (
    NARROW_DEIT,
    _sizes,
    _step_overrides,
    measure_distillation,
    measure_fp16,
    measure_pipelines,
    measure_train_steps,
    parse_args,
    peak_memory,
    pipeline_where,
    table,
)
from deit_ablate.config.schema import RuntimeConfig
from deit_ablate.core.distributed import bind_device, choose_device, device_generator, process_group_backend
from deit_ablate.core.streams import seed_torch
from deit_ablate.data.batch import seed_erasing
from deit_ablate.data.dali import copy_target, dali_device_id
from deit_ablate.data.loader import build_loader
from deit_ablate.run.assemble import ddp_device_ids
from deit_ablate.run.teacher import teacher_layout
from deit_ablate.train.optim import build_optimizer
from deit_ablate.train.sam import ClockEvent, PassTimer, rng_state, set_rng_state
from deit_ablate.train.teacher import teacher_forward
from tests.conftest import REPO

CPU = torch.device("cpu")
SIZES = _sizes(dry=True)


@dataclasses.dataclass
class Recorded:
    """Which DeviceCalls a function made, in order."""

    names: list[str] = dataclasses.field(default_factory=list)

    def calls(self, peak_bytes: int | None = None) -> DeviceCalls:
        """cpu_calls(), each call recorded; with `peak_bytes`, a stand-in for torch.cuda.max_memory_allocated."""
        base = cpu_calls()

        def recorded(name, fn):
            def call(*args):
                self.names.append(name if not args else f"{name}({args[0]})")
                return fn(*args)
            return call

        fields = {f.name: recorded(f.name, getattr(base, f.name)) for f in dataclasses.fields(DeviceCalls)}
        if peak_bytes is not None:  # stands in for the one CUDA call torch.cuda.max_memory_allocated
            fields["peak_memory_bytes"] = recorded("peak_memory_bytes", lambda: peak_bytes)
        return DeviceCalls(**fields)


@pytest.fixture(scope="module")
def data_root(data_cache) -> str:
    return str(data_cache / "builtin")


@pytest.fixture(scope="module")
def setup(data_root) -> step.StepSetup:
    """One trainer of the check's train-step figure, at 224 px with the narrow DeiT, shared by the tests below."""
    assert SIZES["size"] == 224 and SIZES["model_overrides"] == NARROW_DEIT
    return step.build_trainer(_step_overrides(SIZES, data_root, "cpu", SIZES["model"]), CPU)


def test_the_setup_trains_on_the_loaders_uint8_batch_through_the_per_batch_transform(setup):
    assert setup.pixels.dtype == torch.uint8 and tuple(setup.pixels.shape) == (8, 224, 224, 3)
    assert setup.targets.dtype == torch.int64 and tuple(setup.targets.shape) == (8,)
    images = setup.images()
    assert images.dtype == torch.float32 and tuple(images.shape) == (8, 3, 224, 224)
    assert setup.trainer.module.patch_embed.patch_size == (16, 16) and len(setup.trainer.module.blocks) == 1


def test_count_syncs_per_step_runs_train_steps_on_the_loaders_batches(setup):
    """On the H200 this raised 'The size of tensor a (224) must match the size of tensor b (3)' (a float N x 3 x H x
    W batch fed to train_steps); on a CPU it returned None and ran nothing."""
    before = setup.trainer.step
    syncs = step.count_syncs_per_step(setup, steps=3)
    assert syncs == 0.0  # no host read inside the steps; the epoch-end loss .item() is not counted
    assert setup.trainer.step == before + 3 and setup.trainer.log_interval != 10**9


def test_count_syncs_per_step_counts_a_host_read_inside_the_step(setup):
    trainer = setup.trainer
    loss_fn = trainer.loss_fn

    def reads_the_loss(images, outputs, targets):
        loss = loss_fn(images, outputs, targets)
        loss.item()  # a host read per step, as a stray .item() in the loss would be
        return loss

    trainer.loss_fn = reads_the_loss
    try:
        assert step.count_syncs_per_step(setup, steps=2) == 1.0
    finally:
        trainer.loss_fn = loss_fn


def test_count_syncs_per_step_switches_the_devices_sync_debug_mode_on_and_off(setup):
    recorded = Recorded()
    assert step.count_syncs_per_step(dataclasses.replace(setup, calls=recorded.calls()), steps=1) == 0.0
    assert recorded.names == ["synchronize", "sync_debug_mode(warn)", "sync_debug_mode(default)"]
    assert torch.overrides._get_current_function_mode() is None  # HostReads left


def test_the_step_timers_run_on_the_setup(setup):
    recorded = Recorded()
    timed = dataclasses.replace(setup, calls=recorded.calls())
    assert step.run_steps(timed, 1) > 0 and recorded.names == ["synchronize", "synchronize"]
    rates = step.alternate({"a": timed}, steps=1, repeats=1, warmup=1)
    assert len(rates["a"]) == 1 and rates["a"][0] > 0
    seconds = step.optimizer_step_seconds({"a": timed}, steps=1, repeats=1)
    assert seconds["a"][0] > 0
    flops = step.train_flops_per_image(setup.trainer.model, 224, CPU)
    assert 5e7 < flops < 2e8  # one block of width 48 over 197 tokens and the patch embedding, forward and backward


def test_train_steps_figures_at_224_with_their_peak_memory(data_root):
    results = {}
    recorded = Recorded()
    # peak_memory_bytes stands in for torch.cuda.max_memory_allocated: 3 GiB
    measure_train_steps(SIZES, CPU, data_root, 1e11, results, recorded.calls(peak_bytes=3 * 2**30))
    for name in ("eager", "compile"):
        figure = results[f"train_step_{name}"]
        assert figure["size"] == 224 and figure["model"] == "deit_tiny_patch16_224" and figure["images_per_s"] > 0
        assert figure["peak_memory_gib"] == 3.0 and 0 < figure["mfu"] < 1
    assert results["train_step_compile"]["compiled"] is True
    assert results["train_step_compile"]["compile_backend"] == "aot_eager"
    assert results["host_syncs_per_step"] == 0.0
    assert recorded.names.count("reset_peak_memory") == 2 and recorded.names.count("empty_cache") == 2
    assert "sync_debug_mode(warn)" in recorded.names
    assert peak_memory(results) == 3.0


def test_fp16_and_distillation_figures_at_224(data_root, tmp_path):
    results = {}
    recorded = Recorded()
    # peak_memory_bytes stands in for torch.cuda.max_memory_allocated: 2 GiB
    calls = recorded.calls(peak_bytes=2 * 2**30)
    measure_fp16(SIZES, CPU, data_root, results, calls)
    measure_distillation(SIZES, CPU, data_root, tmp_path, results, calls)
    fp16, distill = results["train_step_fp16"], results["distill_hard_token_step"]
    assert fp16["size"] == distill["size"] == 224 and fp16["peak_memory_gib"] == distill["peak_memory_gib"] == 2.0
    assert fp16["loss_first"] > 0 and 0 <= fp16["amp_skipped_steps"] <= fp16["steps"]
    assert distill["student"] == "VisionTransformerDistilled" and distill["images_per_s"] > 0
    assert recorded.names.count("empty_cache") == 2


def test_pipeline_figures_at_224(data_root, tmp_path):
    results = {}
    measure_pipelines(SIZES, CPU, data_root, 16, tmp_path, results)
    assert results["pipeline_pil"]["train_size"] == 224 and results["pipeline_pil"]["images_per_s"] > 0
    dali = results["pipeline_dali"]
    assert "error" in dali or (dali["images_per_s"] > 0 and dali["where"] == "DALI on the CPU")


def test_the_device_dependent_choices_for_a_gpu():
    gpu = torch.device("cuda", 0)  # a device object only: nothing below touches CUDA
    assert pipeline_where("dali", gpu) == "DALI on the GPU (mixed decoder)"
    assert pipeline_where("dali", CPU) == "DALI on the CPU"
    assert pipeline_where("pil", gpu) == pipeline_where("pil", CPU)
    assert matmul_setting(gpu) == (torch.bfloat16, 8192) and matmul_setting(CPU) == (torch.float32, 1024)
    assert peak_memory({"a": {"peak_memory_gib": None}, "b": {}}) is None
    assert isinstance(device_calls(gpu), DeviceCalls) and set(vars(cuda_calls(gpu))) == set(vars(cpu_calls()))


def test_the_gpus_matmul_dtype_and_description_on_the_cpu():
    dtype, _ = matmul_setting(torch.device("cuda"))
    rate = matmul_rate(CPU, n=64, repeats=1, dtype=dtype)  # bf16, as on the GPU
    assert rate["dtype"] == "bfloat16" and rate["flops_per_s"] > 0
    # accelerator stands in for torch.cuda.get_device_name and device_count
    info = describe(CPU, dataclasses.replace(cpu_calls(), accelerator=lambda: ("NVIDIA H200", 8)))
    assert info["gpu"] == "NVIDIA H200" and info["gpu_count"] == 8
    assert info["summary"].startswith("NVIDIA H200 (1 of 8)")
    assert describe(CPU)["summary"].startswith("CPU ")


def test_the_table_and_json_of_a_cpu_report(tmp_path):
    args = parse_args([str(tmp_path / "out.json"), "--dry"])
    assert args.dry and args.jpegs is None
    report = {"device": {"summary": "CPU"}, "seconds": 1.0,
              "results": {"matmul_bf16_tflops": 0.1, "matmul_dtype": "float32", "peak_memory_gib": None}}
    assert "peak GPU memory" in table(report) and json.dumps(report)


# ---------------------------------------------------------------------------------------------------------------------
# The package's other CUDA branches (docs/testing.md, "Code paths a GPU takes, run on the CPU")

GPU = torch.device("cuda", 1)  # a device object only: the functions below are handed it, not CUDA


def test_process_groups_and_the_device_binding_of_a_gpu_rank():
    assert process_group_backend(GPU) == "nccl" and process_group_backend(CPU) == "gloo"
    bound = []
    bind_device(GPU, set_device=bound.append)  # stands in for torch.cuda.set_device
    bind_device(CPU, set_device=bound.append)
    assert bound == [GPU]
    assert choose_device("cuda", 3).type == "cuda" and choose_device("cuda:1", 0) == GPU
    if not torch.cuda.is_available():
        assert choose_device("auto", 0) == CPU
    assert ddp_device_ids(GPU) == [1] and ddp_device_ids(CPU) is None


def test_the_device_generator_that_erasing_and_sam_reseed():
    generators = [torch.Generator(), torch.Generator()]  # stand in for torch.cuda.default_generators
    assert device_generator(GPU, generators) is generators[1] and device_generator(CPU) is torch.default_generator
    seed_erasing(7, CPU)
    drawn = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4))
    state = rng_state(CPU)
    first = torch.rand(4)
    set_rng_state(state, CPU)
    assert torch.equal(first, torch.rand(4))


def test_a_micro_batch_seeds_every_gpu_once_cuda_is_in_use(monkeypatch):
    seeded_gpus = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # stands in for a run on a GPU
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded_gpus.append)  # stands in for the GPUs' generators
    seed_torch(11)
    drawn = torch.rand(4)
    torch.default_generator.manual_seed(11)
    assert seeded_gpus == [11] and torch.equal(drawn, torch.rand(4))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_sams_pass_timer_on_clock_events(device):
    timer = PassTimer(device, event=ClockEvent if device.type == "cuda" else None)  # ClockEvent stands in for
    if device.type == "cuda":  # torch.cuda.Event on the GPU device object
        assert PassTimer(device).event.func is torch.cuda.Event
    else:
        assert timer.event is ClockEvent
    for _ in range(2):
        timer.start_step()
        for _ in range(3):  # second pass begins, ends; the step ends
            sum(range(20_000))
            timer.mark()
    share = timer.share()
    assert share is not None and 0 < share < 1 and timer.share() is None


def test_the_teacher_under_bf16_autocast_and_its_gpu_layout():
    torch.manual_seed(0)
    teacher = timm.create_model("resnet10t", num_classes=10).eval()
    images = torch.randn(2, 3, 64, 64)
    full = teacher_forward(teacher, images)  # the CPU's default: full precision
    half = teacher_forward(teacher, images, bf16=True)  # the GPU's default, run by the CPU's bf16 autocast
    assert half.dtype == full.dtype == torch.float32 and not torch.equal(half, full)
    torch.testing.assert_close(half, full, rtol=0.1, atol=0.1)
    laid_out = teacher_layout(copy.deepcopy(teacher), GPU)
    assert laid_out.conv1[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert teacher_layout(teacher, CPU).conv1[0].weight.is_contiguous()
    vit = timm.create_model("deit_tiny_patch16_224", depth=1, embed_dim=48, num_heads=3, img_size=32)
    assert teacher_layout(vit, GPU) is vit


def test_dali_on_a_gpu_reads_its_device_and_stream():
    assert dali_device_id(GPU) == 1 and dali_device_id(CPU) is None
    assert dali_device_id(torch.device("cuda"), current_device=lambda: 5) == 5  # stands in for current_device
    # stands in for torch.cuda.current_stream
    assert copy_target(1, current_stream=lambda device: f"stream of {device}") == (GPU, "stream of cuda:1")
    assert copy_target(None) == (CPU, None)


def test_the_host_side_settings_a_gpu_changes(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    assert optimizer.param_groups[0]["fused"] is True  # CPU and CUDA parameters take the fused AdamW
    loader = build_loader(list(range(8)), None, 4, RuntimeConfig(num_workers=0), train=False)
    assert loader.pin_memory is torch.cuda.is_available()
    assert build_sharpness_parser().parse_args(["run"]).device == "auto"


def _scopes(node: ast.AST, prefix: str = "") -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and class under `node`."""
    scopes = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scopes.append((child.lineno, child.end_lineno, prefix + child.name))
            scopes += _scopes(child, prefix + child.name + ".")
        else:
            scopes += _scopes(child, prefix)
    return scopes


# A line on a GPU's side: it says `cuda`, or DALI's words for the GPU (a "mixed" or "gpu" device, `.gpu()`, a `gpu`
# flag), which never say `cuda` (issue 53, point 4).
GPU_WORDS = re.compile(r'cuda|"mixed"|== "gpu"|\.gpu\(\)|\bgpu"?\s*[:=]')


def cuda_functions(package: Path) -> dict[str, list[int]]:
    """`file:function` (`file:<module>` outside any) of every line of the package on a GPU's side (GPU_WORDS), with
    the lines."""
    found: dict[str, list[int]] = {}
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        lines = [number for number, line in enumerate(source.splitlines(), 1) if GPU_WORDS.search(line)]
        if not lines:
            continue
        scopes = _scopes(ast.parse(source))
        for line in lines:
            inner = [scope for scope in scopes if scope[0] <= line <= scope[1]]
            name = max(inner)[2] if inner else "<module>"
            found.setdefault(f"{path.relative_to(package).as_posix()}:{name}", []).append(line)
    return found


def docs_table() -> dict[str, list[str]]:
    """The rows of docs/testing.md's "Code paths a GPU takes, run on the CPU": function -> the tests named."""
    text = (REPO / "docs" / "testing.md").read_text()
    section = text.split("## Code paths a GPU takes, run on the CPU", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and ":" in cells[0]:
            rows[cells[0].strip("`")] = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cells[2])
    return rows


def test_every_cuda_branch_is_in_the_table():
    found, rows = cuda_functions(REPO / "deit_ablate"), docs_table()
    missing = {name: lines for name, lines in found.items() if name not in rows}
    assert not missing, (f"functions that say `cuda` (file:function: lines) without a row in docs/testing.md's 'Code "
                         f"paths a GPU takes, run on the CPU': {missing}. Add a CPU test that runs the GPU side "
                         "(a stand-in for the one CUDA call only) and a row naming it, or merge the branch away.")
    stale = sorted(set(rows) - set(found))
    assert not stale, f"rows of docs/testing.md whose function no longer says `cuda`: {stale}; delete them"
    for name, tests in rows.items():
        assert tests, f"the row of {name} names no test (`tests/test_x.py::test_name`)"
        for file, test in tests:
            assert re.search(rf"^def {test}\(", (REPO / file).read_text(), re.M), f"{name}: {file}::{test} is no test"
