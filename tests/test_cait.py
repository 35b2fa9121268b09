"""CaiT's "going deeper" ablations as a second study: the rows compose like Table 8's, the model options match
their definitions (Touvron et al. 2021b, sections 2, 3, 4.1, 4.3 and appendix A), a row trains, appendix A's control
takes the diagonal its LayerScale run learned, and the aggregator rebuilds the study's table in the paper's order."""

from __future__ import annotations

import json
import sys
from dataclasses import fields

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from timm.layers import Attention

from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.html import to_html
from deit_ablate.analysis.aggregate.paper import paper_table
from deit_ablate.analysis.aggregate.plot import draw_deltas
from deit_ablate.analysis.aggregate.reader import RunInfo, read_offline
from deit_ablate.analysis.aggregate.render import render
from deit_ablate.analysis.aggregate.table import build_table
from deit_ablate.config.keys import NOT_EXPERIMENT
from deit_ablate.config.schema import Config
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.identity import composed_choices, experiment, run_identity
from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.plan import make_plan
from deit_ablate.run.stages import layer_scale_run_dir
from deit_ablate.run.validate import validate_config
from deit_ablate.train.deeper import (
    ClassAttentionViT,
    ScalarScale,
    TalkingHeadsAttention,
    drop_path_rates,
    layer_scale_digest,
    layer_scale_values,
    set_layer_scale,
)
from deit_ablate.train.models import build_model, resize_pos_embed_state
from hydra_plugins.deit_ablate_launcher.slurm import submission_order, upstream_jobs
from tests.conftest import CONF, REPO, TINY, compose_config, identity_of, run_train, study_rows
from tests.test_ablation import _flat

# Each row: the row it extends, and the one ingredient it changes, at paper scale and at demo scale.
UNIFORM = {12: 0.05, 18: 0.1, 24: 0.2, 36: 0.25}  # d_r: 0.25 at 36 is CaiT's Table 1; the others are ours
EPS = {12: 0.1, 18: 0.1, 24: 1e-5, 36: 1e-6}  # section 2
DEMO_DEPTH = {12: 4, 18: 6, 24: 8, 36: 12}
ROWS: dict[str, tuple[str | None, dict, dict]] = {}
for _d in (12, 18, 24, 36):
    if _d != 12:
        ROWS[f"depth{_d}"] = ("depth12", {"model.kwargs.depth": _d}, {"model.kwargs.depth": DEMO_DEPTH[_d]})
    _uniform = {"model.kwargs.drop_path_schedule": "uniform"}
    if UNIFORM[_d] != 0.1:  # DeiT's rate is 0.1: at depth 18 only the schedule changes
        _uniform["model.drop_path"] = UNIFORM[_d]
    ROWS[f"depth{_d}_uniform"] = (f"depth{_d}", _uniform, _uniform)
    ROWS[f"depth{_d}_rezero"] = (f"depth{_d}_uniform", *[{"model.kwargs.branch_scale": "scalar"}] * 2)
    ROWS[f"depth{_d}_layerscale"] = (f"depth{_d}_uniform", *[{"model.kwargs.init_values": EPS[_d]}] * 2)
ROWS.update({
    "avgpool": ("depth12", *[{"model.kwargs.class_token": False, "model.kwargs.global_pool": "avg"}] * 2),
    "ca_10_2": ("depth12", {"model.kwargs.depth": 10, "model.kwargs.class_attn_depth": 2},
                {"model.kwargs.depth": 3, "model.kwargs.class_attn_depth": 1}),
    "ca_12_2": ("depth12", {"model.kwargs.class_attn_depth": 2}, {"model.kwargs.class_attn_depth": 1}),
    "ls_init_zero": ("depth18_layerscale", *[{"model.kwargs.layer_scale_init": "zero"}] * 2),
    "ls_init_uniform": ("depth18_layerscale", *[{"model.kwargs.layer_scale_init": "uniform"}] * 2),
    "ls_fixed": ("depth18_layerscale", *[{"model.kwargs.layer_scale_learned": False,
                                          "model.kwargs.layer_scale_from": "depth18_layerscale"}] * 2),
    "depth48_uniform": ("depth36_uniform", {"model.kwargs.depth": 48, "model.drop_path": 0.3},
                        {"model.kwargs.depth": 16, "model.drop_path": 0.3}),  # 36 -> 48: 0.25 + 0.05, ours
    "talking_heads": ("depth12", *[{"model.kwargs.talking_heads": True}] * 2),
    "heads8": ("depth12", *[{"model.kwargs.num_heads": 8}] * 2),
    "crop_1_0": ("depth12", *[{"resolution.crop_pct": 1.0}] * 2),
    "cait_s36_no_ca_layerscale": ("cait_s36", *[{"model.kwargs.class_attn_layer_scale": False}] * 2),
    "cait_s36_500ep": ("cait_s36", {"train.epochs": 500}, {"train.epochs": 17}),
})
ROOTS = ("depth12", "cait_s36")


def test_every_row_has_an_option_and_a_paper_row_in_order():
    assert sorted(p.stem for p in (CONF / "cait").glob("*.yaml")) == sorted([*ROOTS, *ROWS])
    table = paper_table("cait")
    assert [r.key for r in table.rows][:4] == ["depth12", "depth12_uniform", "depth12_rezero", "depth12_layerscale"]
    assert {r.key for r in table.rows} == {*ROOTS, *ROWS}
    assert {r.key: r.baseline for r in table.rows if r.key in ROWS} == {k: v[0] for k, v in ROWS.items()}
    # Only where the text states a number: DeiT-S's 79.9 and 80.3 with talking heads (section 4.3), Table 1's 36
    # blocks at d_r 0.25 without and with LayerScale, 80.7 at 48 blocks with d_r raised (section 4.1), CaiT-S36's
    # (section 4.5.4, appendix B).
    assert {r.key: r.values["pretrain"] for r in table.rows if r.values["pretrain"] is not None} == {
        "depth12": 79.9, "talking_heads": 80.3, "depth36_uniform": 81.9, "depth36_layerscale": 82.9,
        "depth48_uniform": 80.7, "cait_s36": 83.44,
        "cait_s36_no_ca_layerscale": 83.36, "cait_s36_500ep": 83.42}


@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_suite_root_is_deit_small_with_deit_recipe(preset):
    cfg = _flat(compose_config([f"preset={preset}", "cait=depth12"]))
    base = _flat(compose_config([f"preset={preset}"]))
    width = {"paper": (16, 384, 6, 12), "demo": (8, 128, 4, 4)}[preset]
    assert tuple(cfg[f"model.kwargs.{k}"] for k in ("patch_size", "embed_dim", "num_heads", "depth")) == width
    assert cfg["model.name"] == "deit_small_patch16_224" and cfg["model.drop_path"] == 0.1
    # Apart from the model, the recipe is Table 8's baseline at that scale.
    assert {k: v for k, v in cfg.items() if not k.startswith("model.")} == \
        {k: v for k, v in base.items() if not k.startswith("model.")}


@pytest.mark.parametrize("preset", ["demo", "paper"])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_differs_from_its_own_baseline_only_in_its_ingredient(row, preset):
    parent, paper, demo = ROWS[row]
    base = _flat(compose_config([f"preset={preset}", f"cait={parent}"]))
    ours = _flat(compose_config([f"preset={preset}", f"cait={row}"]))
    diff = {key: ours[key] for key in set(ours) | set(base) if ours.get(key, "absent") != base.get(key, "absent")}
    assert diff == (paper if preset == "paper" else demo)


def test_table_8_is_unchanged_by_the_study():
    # No `cait` choice is the default, and the study adds no key: a Table 8 run's experiment (what its name and
    # wandb id hash) and its logged choices are what they were before the study existed.
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        plain = compose("config", overrides=["ablation=no_mixup"], return_hydra_config=True)
    assert plain.hydra.runtime.choices.cait is None  # left out of the logged choices (tracking.hydra_choices)
    experiment_nodes = {f.name for f in fields(Config)} - set(NOT_EXPERIMENT)
    assert set(experiment(plain)) == experiment_nodes
    # with the choices, Table 8's row as the schema key it was (keys.legacy_keys), and nothing of the study
    assert set(experiment(plain, choices=composed_choices(plain))) == experiment_nodes | {"ablation"}
    assert dict(plain.model.kwargs) == {"patch_size": 8, "embed_dim": 128, "depth": 6, "num_heads": 4}
    assert run_identity(plain, ["ablation=no_mixup"], composed_choices(plain)).name.startswith("ablation=no_mixup-")
    assert identity_of(["cait=depth24"]).name.startswith("cait=depth24-")


def _build(row: str, **extra) -> torch.nn.Module:
    cfg = compose_config([f"cait={row}"] + [f"++model.kwargs.{k}={v}" for k, v in extra.items()])
    torch.manual_seed(0)
    return build_model(cfg.model, 10, img_size=32)


def test_uniform_drop_path_is_the_same_rate_in_every_block_and_linear_is_linspace():
    def rates(row):  # attention and MLP branch of each block
        return [rate for pair in drop_path_rates(_build(row)) for rate in pair]

    assert rates("depth18") == pytest.approx([0.0, 0.0, 0.02, 0.02, 0.04, 0.04, 0.06, 0.06, 0.08, 0.08, 0.1, 0.1])
    assert rates("depth18_uniform") == pytest.approx([0.1] * 12)  # 6 demo blocks
    assert rates("depth36_uniform") == pytest.approx([0.25] * 24)


def _gammas(model):
    return [ls.gamma for block in model.blocks for ls in (block.ls1, block.ls2)]


def test_layer_scale_initialisations_of_appendix_a():
    const = _gammas(_build("depth18_layerscale"))
    assert all(torch.equal(g, torch.full((128,), 0.1)) and g.requires_grad for g in const)
    assert all(torch.equal(g, torch.zeros(128)) and g.requires_grad for g in _gammas(_build("ls_init_zero")))
    uniform = torch.stack(_gammas(_build("ls_init_uniform")))
    assert uniform.min() >= 0 and uniform.max() <= 0.2 and uniform.std() > 0.03  # U[0, 0.2] per channel
    assert abs(uniform.mean().item() - 0.1) < 0.01  # the same mean as epsilon (1536 draws: sd of mean 0.0015)
    # The control's diagonal is not learned; its values come from its LayerScale run when the run starts (below).
    assert not any(g.requires_grad for g in _gammas(_build("ls_fixed")))
    assert _gammas(_build("depth24_layerscale"))[0][0].item() == pytest.approx(1e-5)


def test_scalar_alpha_starts_at_zero_and_a_block_at_zero_is_the_identity():
    model = _build("depth12_rezero")
    scales = [s for block in model.blocks for s in (block.ls1, block.ls2)]
    assert all(isinstance(s, ScalarScale) and s.alpha.shape == () and s.alpha.item() == 0 for s in scales)
    model.eval()
    x = torch.randn(3, 17, 128)
    block = model.blocks[0]
    assert torch.equal(block(x), x)
    block.ls1.alpha.data.fill_(0.5)
    by_hand = x + 0.5 * block.attn(block.norm1(x))
    assert torch.allclose(block(x), by_hand + block.ls2(block.mlp(block.norm2(by_hand))), atol=1e-6)
    assert sum(p.numel() for n, p in model.named_parameters() if n.endswith("alpha")) == 2 * 4


def test_average_pooling_model_has_no_class_token_and_averages_the_patches():
    model = _build("avgpool").eval()
    assert model.cls_token is None and model.pos_embed.shape == (1, 16, 128)
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 16, 128)
    assert torch.allclose(model(x), model.head(model.fc_norm(tokens.mean(dim=1))), atol=1e-6)


def test_class_attention_stage_updates_only_the_class_embedding():
    model = _build("ca_12_2").eval()
    assert isinstance(model, ClassAttentionViT) and len(model.blocks) == 4 and len(model.blocks_token_only) == 1
    assert model.pos_embed.shape == (1, 16, 128)  # the patches only: the class embedding enters later
    x = torch.randn(2, 3, 32, 32)
    patches = model.blocks(model.patch_embed(x) + model.pos_embed)
    block = model.blocks_token_only[0]
    cls = model.cls_token.expand(2, -1, -1)
    # CA by hand (section 3): the class embedding queries itself and the patches; the patches are not written.
    u = block.norm1(torch.cat([cls, patches], dim=1))
    attn = block.attn
    heads, dim = attn.num_heads, 128
    q = attn.q(u[:, :1]).reshape(2, 1, heads, dim // heads).transpose(1, 2)
    k = attn.k(u).reshape(2, 17, heads, dim // heads).transpose(1, 2)
    v = attn.v(u).reshape(2, 17, heads, dim // heads).transpose(1, 2)
    weights = (q @ k.transpose(-2, -1) * (dim // heads) ** -0.5).softmax(dim=-1)
    ca = attn.proj((weights @ v).transpose(1, 2).reshape(2, 1, dim))
    cls = cls + ca  # LayerScale off in the trunk: the CA block's diagonal is a fixed 1
    cls = cls + block.mlp(block.norm2(cls))
    assert torch.allclose(model(x), model.head(model.norm(cls)[:, 0]), atol=1e-5)
    assert not block.gamma_1.requires_grad and torch.equal(block.gamma_1, torch.ones(128))
    # With LayerScale in the trunk, the CA blocks learn theirs from the same epsilon.
    scaled = _build("ca_12_2", init_values=0.1)
    assert scaled.blocks_token_only[0].gamma_1.requires_grad and scaled.blocks_token_only[0].gamma_1[0] == 0.1
    assert {"cls_token", "pos_embed"} <= scaled.no_weight_decay()


@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_cait_s36_is_timms_cait_with_the_papers_settings(preset):
    cfg = _flat(compose_config([f"preset={preset}", "cait=cait_s36"]))
    depth, epochs = (36, 400) if preset == "paper" else (12, 13)
    model = tuple(cfg[f"model.kwargs.{key}"] for key in ("depth", "num_heads", "init_values"))
    assert model == (depth, 8, 1e-6) and cfg["model.name"] == "cait_s24_224"
    assert (cfg["train.epochs"], cfg["resolution.crop_pct"]) == (epochs, 1.0)


def test_cait_without_layer_scale_in_class_attention_fixes_its_diagonal_at_one():
    with_ls, without = _build("cait_s36"), _build("cait_s36_no_ca_layerscale")
    assert torch.equal(with_ls.blocks_token_only[0].gamma_1, torch.full((128,), 1e-6))
    assert with_ls.blocks_token_only[0].gamma_1.requires_grad and with_ls.blocks[0].gamma_1.requires_grad
    for block in without.blocks_token_only:
        assert torch.equal(block.gamma_1, torch.ones(128)) and not block.gamma_2.requires_grad
    assert torch.equal(without.blocks[0].gamma_1, torch.full((128,), 1e-6))  # the trunk keeps its LayerScale
    drop = [block.drop_path.drop_prob for block in without.blocks]
    assert drop == [0.2] * 12  # timm's Cait: uniform stochastic depth


def test_talking_heads_mix_the_heads_attention_before_and_after_the_softmax():
    attn = _build("talking_heads").blocks[0].attn.eval()
    assert isinstance(attn, TalkingHeadsAttention) and attn.proj_l.weight.shape == attn.proj_w.weight.shape == (4, 4)
    plain = Attention(128, 4, qkv_bias=True).eval()  # timm's ViT attention with the same q, k, v and projection
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k.split(".")[0] in ("qkv", "proj")})
    x = torch.randn(2, 17, 128)

    def mixed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:  # the heads x heads mixing matrices
        with torch.no_grad():
            for linear, weight in ((attn.proj_l, before), (attn.proj_w, after)):
                linear.weight.copy_(weight)
                linear.bias.zero_()
            return attn(x)

    eye = torch.eye(4)
    assert torch.allclose(mixed(eye, eye), plain(x), atol=1e-5)  # no mixing: plain multi-head attention
    # A permutation, before or after the softmax, gives head h the attention map of head perm[h] (its own values).
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        q, k, v = plain.qkv(x).reshape(2, 17, 3, 4, 32).permute(2, 0, 3, 1, 4)
        maps = (q @ k.transpose(-2, -1) * 32**-0.5).softmax(dim=-1)
        by_hand = plain.proj((maps[:, perm] @ v).transpose(1, 2).reshape(2, 17, 128))
    assert not torch.allclose(by_hand, plain(x), atol=1e-3)
    assert torch.allclose(mixed(eye[perm], eye), by_hand, atol=1e-5)
    assert torch.allclose(mixed(eye, eye[perm]), by_hand, atol=1e-5)


def test_talking_heads_give_every_parameter_a_gradient():
    # What DDP needs (it stops at the second step on a trainable parameter without a gradient).
    model = _build("talking_heads")
    model(torch.randn(2, 3, 32, 32)).logsumexp(dim=-1).sum().backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    mixing = [p.grad for n, p in model.named_parameters() if n.endswith(("proj_l.weight", "proj_w.weight"))]
    assert len(mixing) == 2 * 4 and all(g.abs().sum() > 0 for g in mixing)


def test_class_attention_model_fine_tunes_at_another_resolution():
    cfg = compose_config(["cait=ca_10_2"])
    small, large = build_model(cfg.model, 10, 32), build_model(cfg.model, 10, 48)
    resized = resize_pos_embed_state(small.state_dict(), large)
    assert resized["pos_embed"].shape == large.pos_embed.shape == (1, 36, 128)
    large.load_state_dict(resized)
    cfg = compose_config(["cait=cait_s36"])  # timm's Cait: no class row in pos_embed either
    small, large = build_model(cfg.model, 10, 32), build_model(cfg.model, 10, 48)
    assert resize_pos_embed_state(small.state_dict(), large)["pos_embed"].shape == (1, 36, 128)


@pytest.mark.parametrize("overrides, message", [
    (["cait=depth12", "++model.kwargs.drop_path_schedule=uniformly"],
     "drop_path_schedule=uniformly is not one of linear, uniform"),
    (["cait=depth12", "++model.kwargs.layer_scale_init=zero"], "LayerScale, which is off"),
    (["model=cnn_demo", "++model.kwargs.class_attn_depth=2"], "class_attn_depth: options of timm's VisionTransformer"),
    (["cait=cait_s36", "++model.kwargs.talking_heads=true"],  # timm's Cait has them already
     "talking_heads: options of timm's VisionTransformer"),
    (["cait=depth18", "++model.kwargs.layer_scale_from=depth18_layerscale"], "LayerScale, which is off"),
    (["cait=ls_fixed", "++model.kwargs.layer_scale_init=zero"], "both set the initial LayerScale diagonal"),
])
def test_bad_model_options_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_model(compose_config(overrides).model, 10, 32)


def test_bad_model_options_are_checked_before_a_run_starts():
    # Checked with the rest of the config before a run starts; a distilled student takes none of them.
    with pytest.raises(ConfigError, match="class_attn_depth: options of timm's VisionTransformer"):
        validate_config(compose_config(["cait=ca_12_2", "distill=hard_token", "distill.teacher.checkpoint=x.pt"]))
    with pytest.raises(ConfigError, match="layer_scale_from=depth18_layerscal is not a row of the cait study"):
        validate_config(compose_config(["cait=ls_fixed", "model.kwargs.layer_scale_from=depth18_layerscal"]))


def test_ls_fixed_refuses_to_start_before_its_layerscale_run_has_finished(tmp_path):
    overrides = ["cait=ls_fixed", f"runtime.output_root={tmp_path}"]
    cfg = compose_config(overrides)

    def plan(cfg, overrides):  # the run's plan, where every input error is raised before anything is written
        return make_plan(cfg, DistInfo(), RunDir(tmp_path / "this-run"), overrides)

    with pytest.raises(ConfigError, match=r"the run 'cait=depth18_layerscale-\w+' learned .* which has not finished "
                                          rf".* Train it first: python train.py cait=depth18_layerscale "
                                          rf"runtime.output_root={tmp_path};"):
        plan(cfg, overrides)
    source = layer_scale_run_dir(Lineage.of(cfg, overrides)).path
    source.mkdir(parents=True)
    RunDir(source).result.write_text(json.dumps({"status": "diverged"}))
    with pytest.raises(ConfigError, match="which ended as diverged"):
        plan(cfg, overrides)
    dry = compose_config([*overrides, "runtime.dry_run=true"])  # the dry run says what the run waits for instead
    assert plan(dry, overrides).layer_scale_source.path == source
    # Only a row that learns LayerScale from epsilon can be the source.
    other = ["cait=ls_fixed", "model.kwargs.layer_scale_from=depth18_uniform"]
    with pytest.raises(ConfigError, match="layer_scale_from=depth18_uniform: that row does not learn LayerScale"):
        plan(compose_config(other), other)


def test_layer_scale_values_of_another_architecture_are_refused():
    model = _build("ls_fixed")  # 6 demo blocks of width 128
    for other, shape in (("depth12_layerscale", "4 blocks of width 128"), ("ls_init_zero", "6 blocks of width 64")):
        values = layer_scale_values(_build(other, embed_dim=64 if other == "ls_init_zero" else 128).state_dict())
        with pytest.raises(ConfigError, match=f"the checkpoint c.pt holds LayerScale diagonals of {shape}, this model "
                                              "has 6 blocks of width 128"):
            set_layer_scale(model, values, "the checkpoint c.pt")
    with pytest.raises(ConfigError, match="the checkpoint c.pt holds no LayerScale diagonals"):
        set_layer_scale(model, layer_scale_values(_build("depth18_uniform").state_dict()), "the checkpoint c.pt")


def _hydra_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_a_slurm_sweep_chains_ls_fixed_after_its_layerscale_run(tmp_path):
    # As a fine-tune waits for its pre-training (afterok), ls_fixed waits for depth18_layerscale of the same sweep.
    common = [f"runtime.output_root={tmp_path}"] + TINY
    jobs = [[f"cait={row}", f"stage={stage}", *common] for row in ("depth18_layerscale", "ls_fixed")
            for stage in ("pretrain", "finetune")]
    configs = [_hydra_config(job) for job in jobs]
    upstream = upstream_jobs(configs, jobs, lambda job: _hydra_config(job).hydra.sweep.subdir)
    assert upstream == {1: 0, 2: 0, 3: 2}  # ls_fixed's fine-tune waits for ls_fixed's pre-training
    assert submission_order({3: 2, 2: 0, 1: 0}) == [(2, 0), (1, 0), (3, 2)]
    # Alone in its sweep and with its LayerScale run untrained, ls_fixed is refused before anything is submitted.
    with pytest.raises(ConfigError, match="has not finished"):
        upstream_jobs(configs[2:3], jobs[2:3], lambda job: _hydra_config(job).hydra.sweep.subdir)


def _info(rid: str, row: str, top1: float, seed: int = 0) -> RunInfo:
    config = {"preset": "demo", "stage": "pretrain", "seed": seed, "ablation": "baseline", "choices": {"cait": row},
              "model": {"kwargs": {"row": row}}}
    return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": top1})


def test_study_table_has_the_papers_order_and_each_rows_own_baseline():
    runs = [_info("a", "depth24_layerscale", 70.0), _info("b", "depth12", 60.0), _info("c", "depth12", 62.0, seed=1),
            _info("d", "depth24_uniform", 65.0), _info("e", "ca_12_2", 66.0), _info("f", "depth24", 58.0)]
    table = build_table(runs, rows="cait", only_present=True)
    assert [r.key for r in table.rows] == ["depth12", "depth24", "depth24_uniform", "depth24_layerscale", "ca_12_2"]
    cells = {r.key: (r.delta_to, r.cells["pretrain"]) for r in table.rows}
    assert cells["depth24_layerscale"][0] == "depth24_uniform" and cells["depth24_layerscale"][1].delta == 5.0
    assert cells["depth24_uniform"][1].delta == 7.0 and cells["ca_12_2"][1].delta == 5.0  # 66 - mean(60, 62)
    assert cells["depth12"][1].paper == 79.9 and cells["ca_12_2"][1].paper is None
    text = render(table, "markdown")
    assert "| depth24_layerscale | depth24_uniform | 70.00 (n=1) | +5.00 | not in the text |" in text
    assert "| depth12 |  | 61.00 ± 1.41 (n=2) | +0.00 | 79.9 | +0.0 |" in text
    assert "Going deeper with Image Transformers" in text
    page = to_html(table, 2, [])
    assert "<td>depth24_<wbr>uniform</td>" in page and "<td>not in the text</td>" in page  # may wrap after a _
    axes = draw_deltas(table).axes[0]  # the roots (depth12; cait_s36) have no bar: they extend no row
    assert [t.get_text() for t in axes.get_yticklabels()] == ["depth24", "depth24_uniform", "depth24_layerscale",
                                                              "ca_12_2"]
    assert axes.get_xlabel() == "Δ top-1 to each row's own baseline (points)"


def test_the_table_shows_the_texts_numbers_for_36_and_48_blocks_and_talking_heads():
    runs = [_info("a", "depth12", 60.0), _info("b", "talking_heads", 61.0), _info("c", "depth36_uniform", 58.0),
            _info("d", "depth48_uniform", 57.5), _info("e", "depth36_layerscale", 59.0)]
    text = render(build_table(runs, rows="cait", only_present=True), "markdown")  # one seed each: said in the caption
    assert "| talking_heads | depth12 | 61.00 | +1.00 | 80.3 | +0.4 |" in text  # section 4.3: 79.9 -> 80.3
    # Table 1 at 36 blocks, d_r 0.25: 81.9 without LayerScale, 82.9 with it; section 4.1: 80.7 at 48 blocks
    assert "| depth36_uniform | depth36 | 58.00 |  | 81.9 |  |" in text  # depth36 ran no seed here
    assert "| depth36_layerscale | depth36_uniform | 59.00 | +1.00 | 82.9 | +1.0 |" in text
    assert "| depth48_uniform | depth36_uniform | 57.50 | -0.50 | 80.7 | -1.2 |" in text


def _dry_run(proc) -> dict[str, tuple[str, str]]:
    """Each row's run name and plan, from the lines of a dry run."""
    lines = [line.removeprefix("[dry run] ") for line in proc.stdout.splitlines()
             if line.startswith("[dry run]") and " computes the same as " not in line]  # a plan line per run
    runs = [(line.split(" ", 1)[0], line.split("): ", 1)[1]) for line in lines]
    return {name.split(",")[0].removeprefix("cait="): (name, plan) for name, plan in runs}


@pytest.mark.slow
def test_ls_fixed_trains_with_the_diagonal_its_layerscale_run_learned(tmp_path, data_cache):
    tiny = TINY + ["train.max_steps=2"]
    plan = _dry_run(run_train(["-m", "cait=glob(*)", "runtime.dry_run=true"] + tiny, tmp_path, data_cache))
    assert sorted(plan) == sorted(study_rows("cait"))
    assert plan["depth48_uniform"][1] == plan["talking_heads"][1] == "train from step 0"
    source_name = plan["depth18_layerscale"][0]
    assert plan["ls_fixed"][1] == f"wait for its LayerScale run {source_name}"
    run_train(["cait=depth18_layerscale"] + tiny, tmp_path, data_cache)
    source = runs_root(tmp_path / "outputs") / source_name
    state = torch.load(RunDir(source).last_checkpoint, weights_only=True)
    learned = layer_scale_values(state["model"])
    assert sorted(learned) == ["blocks.0.ls1.gamma", "blocks.0.ls2.gamma"]
    assert all(not torch.equal(g, torch.full_like(g, 0.1)) for g in learned.values())  # two steps moved them
    learned = {key: torch.rand_like(g) + 1.0 for key, g in learned.items()}  # far from epsilon, unlike each other
    torch.save({**state, "model": {**state["model"], **learned}}, RunDir(source).last_checkpoint)
    plan = _dry_run(run_train(["cait=ls_fixed", "runtime.dry_run=true"] + tiny, tmp_path, data_cache))
    assert plan["ls_fixed"][1] == f"train from step 0, LayerScale diagonal fixed at the values of {source_name}"
    run_train(["cait=ls_fixed"] + tiny, tmp_path, data_cache)
    run = runs_root(tmp_path / "outputs") / plan["ls_fixed"][0]
    fixed = layer_scale_values(torch.load(RunDir(run).last_checkpoint, weights_only=True)["model"])
    result = json.loads(RunDir(run).result.read_text())
    assert result["status"] == "finished" and result["steps_done"] == 2  # two steps later, still the source's values
    assert fixed.keys() == learned.keys() and all(torch.equal(fixed[key], g) for key, g in learned.items())
    assert all(g.min() >= 1.0 for g in fixed.values())  # not epsilon (0.1)
    assert result["layer_scale_from"] == {"run": source_name, "digest": layer_scale_digest(learned)}
    assert f"fixed at the values the run {source_name} learned (digest {layer_scale_digest(learned)})" in \
        RunDir(run).log.read_text()


@pytest.mark.slow
def test_a_demo_row_with_class_attention_trains_under_ddp_and_the_aggregator_finds_the_study(tmp_path, data_cache,
                                                                                            capsys, one_step_run):
    # Two Gloo processes, two steps of the class-attention model with a fixed LayerScale: a parameter left without
    # a gradient (a fixed diagonal counted as trainable, an unused token) would stop DDP at its second step.
    tiny = [a for a in TINY if not a.startswith("model.kwargs.")]
    args = ["cait=ca_10_2", "model.kwargs.depth=1", "++model.kwargs.init_values=0.1",
            "++model.kwargs.layer_scale_learned=false", "train.max_steps=2"] + tiny
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29541",
                str(REPO / "train.py")]
    run_train(args, tmp_path, data_cache, module=torchrun)
    run_train(["cait=depth12_rezero", "model.kwargs.depth=1", "train.max_steps=2"] + tiny, tmp_path, data_cache)
    results = [json.loads(p.read_text()) for p in (runs_root(tmp_path / "outputs")).glob("cait=*/result.json")]
    assert sorted(r["status"] for r in results) == ["finished", "finished"]
    assert all(r["steps_done"] == 2 for r in results)
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert sorted(r.config["choices"]["cait"] for r in runs) == ["ca_10_2", "depth12_rezero"]
    assert sorted(tag for r in runs for tag in r.tags if tag.startswith("cait=")) == ["cait=ca_10_2",
                                                                                    "cait=depth12_rezero"]
    assert OmegaConf.create(runs[0].config).model.name == "deit_small_patch16_224"
    wandb_dir, out = str(wandb_root(tmp_path / "outputs")), tmp_path / "cait.json"
    assert cli.main([wandb_dir, "--format", "json", "--out", str(out), "-q"]) == 0  # only the study's runs
    table = json.loads(out.read_text())
    assert table["rows_key"] == "cait" and table["paper"]["table"] == "cait"
    present = [r["key"] for r in table["rows"] if r["cells"]["pretrain"]["n"]]
    assert present == ["depth12_rezero", "ca_10_2"]  # Table 1 before Table 2, as in the paper
    # Among other runs (a Table 8 run here), Table 8 by default; `--paper cait` picks the study's runs.
    one_step_run.copy_into(tmp_path)  # TINY + train.max_steps=1 train.micro_batch=16, trained once per session
    assert cli.main([wandb_dir, "--format", "json", "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["paper"]["table"] == "table8"
    assert cli.main([wandb_dir, "--paper", "cait", "--format", "json", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert [r["key"] for r in table["rows"] if r["cells"]["pretrain"]["n"]] == present
    assert "1 run(s) that are not rows of the cait study left out" in capsys.readouterr().err
