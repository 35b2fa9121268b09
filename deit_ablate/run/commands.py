"""What every command-line entry point does around its work: the config schema and resolvers registered (a run's
saved config holds `${at_scale:...}` and the like, which only they resolve), Hydra overrides checked with the quoting
that fixes them, and Ctrl-C ended with one line and exit status 130, never a traceback (every file the commands write
is replaced atomically, so an interrupted write leaves the previous file as it was).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from deit_ablate.core import ctrl_c
from deit_ablate.core.ctrl_c import INTERRUPTED, stopped_line

Main = TypeVar("Main", bound=Callable[..., int | None])


def prepare_configs() -> None:
    """Register the schema and the resolvers: every entry point passes through here before it composes or loads a
    config."""
    from deit_ablate.config.compose import register_configs
    from deit_ablate.record.resolvers import register_resolvers

    register_configs()
    register_resolvers()


def interrupted(name: str) -> int:
    """Say in one line that `name` stopped on Ctrl-C; the exit status to end with."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the line is said once: a second Ctrl-C cannot cut it
    print(f"\n{stopped_line(name)}", file=sys.stderr)
    return INTERRUPTED


def command(name: str) -> Callable[[Main], Main]:
    """Wrap an entry point's `main`: configs prepared first, and a Ctrl-C ends it with one line and status 130."""

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int | None:
            try:
                prepare_configs()
                ctrl_c.working()
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                return interrupted(name)
            except BaseException:  # what a Ctrl-C turned into inside a library (omegaconf: an AttributeError)
                if ctrl_c.was_interrupted():
                    return interrupted(name)
                raise

        return run  # type: ignore[return-value]

    return wrap


# The analysis extra (pyproject.toml): the aggregator's intervals (scipy) and figures (matplotlib). A GPU node's
# wheelhouse leaves it out (scripts/wheelhouse.sh); training and deit-status never import it.
ANALYSIS_EXTRA = ("scipy", "matplotlib")


def missing_extra(packages: tuple[str, ...]) -> str | None:
    """The first of `packages` that cannot be imported here, or None (found without importing it)."""
    import importlib.util

    return next((package for package in packages if importlib.util.find_spec(package) is None), None)


def run_entry(name: str, target: str, needs: tuple[str, ...] = ()) -> int:
    """Import and run `target` ("module:function") as command `name`, a Ctrl-C at any moment ending it with one line
    and status 130: during its imports (seconds of torch, timm, wandb), which happen before `command` wraps its main,
    and during the interpreter's exit, where it is ignored (the command's work is done). A package of `needs` missing
    (an extra not installed) ends it at once with one line and status 2."""
    ctrl_c.take_ctrl_c(name)  # the console scripts come here first: before the imports, which take seconds
    missing = missing_extra(needs)
    if missing:
        print(f"{name}: needs {missing}, from deit-ablate's analysis extra, which is not installed here; install it "
              "with `pip install 'deit-ablate[analysis]'` (scripts/install.sh does)", file=sys.stderr)
        return 2
    try:
        from deit_ablate.core.imports import keep_wandb_out_of_timm

        keep_wandb_out_of_timm()  # timm comes without wandb (core/imports.py); a command that logs imports it itself
        module, _, function = target.partition(":")
        status = getattr(importlib.import_module(module), function)()
    except KeyboardInterrupt:
        return interrupted(name)
    except BaseException:
        if ctrl_c.was_interrupted():
            return interrupted(name)
        raise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status or 0


def deit_aggregate() -> int:
    """The `deit-aggregate` console script (analysis/aggregate/cli.py)."""
    return run_entry("deit-aggregate", "deit_ablate.analysis.aggregate.cli:main", needs=ANALYSIS_EXTRA)


def deit_status() -> int:
    """The `deit-status` console script (analysis/status/cli.py)."""
    return run_entry("deit-status", "deit_ablate.analysis.status.cli:main")


def number_option(kind: type, low: float | None = None, above: bool = False) -> Callable[[str], float]:
    """An argparse `type` for a numeric option: a finite `kind` (int or float), at least `low` (more than it with
    `above`); anything else an argparse error naming the value and the range (NaN passed every comparison)."""
    bound = "" if low is None else f" {'>' if above else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if not math.isfinite(value) or (low is not None and (value <= low if above else value < low)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: a finite number{bound}")
        return value

    parse.__name__ = kind.__name__
    return parse


def quoted(override: str) -> str:
    """`key=value` as the shell must be given it for Hydra to read the value as one string."""
    key, _, value = override.partition("=")
    if '"' in value and "'" not in value:
        return f"\"{key}='{value}'\""
    return f"'{key}=\"{value}\"'"


def check_overrides(argv: list[str]) -> None:
    """Each Hydra override on the command line parses by Hydra's grammar; else one paragraph naming the override and
    the quoting that fixes it, and exit status 2 (Hydra itself says only `mismatched input '='`)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args, _ = get_args_parser().parse_known_args(argv)
    parser = OverridesParser.create()
    for override in args.overrides:
        try:
            parser.parse_override(override)
        except HydraException as error:
            problem = str(error).splitlines()[0]
            print(f"\nerror: the override {override} is not one Hydra can read ({problem}). A value holding '=', a "
                  "space, a comma, brackets, braces, parentheses or quotes must be quoted for Hydra, inside the "
                  f"shell's own quotes: {quoted(override)}\n", file=sys.stderr)
            sys.exit(2)
    check_interpolations(args.overrides)


def check_interpolations(overrides: list[str]) -> None:
    """Each override whose value holds a `${...}` resolves in the composed config; else one line naming the key
    and the fix (`${HOME}` names a config key: an environment variable is `${oc.env:HOME}`), exit status 2, where
    Hydra would print OmegaConf's traceback from resolving its run folder. Composes only when a value holds one."""
    import re

    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    from deit_ablate.config.compose import compose_run_config

    keyed = [o for o in overrides if "${" in o.partition("=")[2] and not o.lstrip("+~").startswith("hydra")]
    if not keyed:
        return
    prepare_configs()
    try:
        cfg = compose_run_config(overrides)
    except Exception:  # noqa: BLE001 - any other problem of the overrides: the launch says it as it always does
        return
    for override in keyed:
        key, _, value = override.lstrip("+~").partition("=")
        try:
            OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except InterpolationResolutionError as error:
            names = re.findall(r"\$\{([A-Za-z_][\w.]*)\}", value)
            fix = value
            for name in names:
                fix = fix.replace(f"${{{name}}}", f"${{oc.env:{name}}}")
            advice = (f"for an environment variable write {key}={fix} (quoted for the shell: '{key}={fix}')"
                      if names else "use ${oc.env:NAME} for an environment variable, or give the value itself")
            problem = str(error).splitlines()[0]
            print(f"\nerror: {key}={value} does not resolve: {problem} (a ${{...}} names a key of the config); "
                  f"{advice}.\n", file=sys.stderr)
            sys.exit(2)


def show_stage_config(argv: list[str]) -> bool:
    """`python train.py <overrides> stage=finetune --cfg job` (or `all`, with `--package`, `--resolve`): print the
    config the stage runs (stage_config.py), where Hydra would print the composed one, and say True; False for
    what Hydra prints as the run runs it (a pre-training, `--cfg hydra`, a sweep, another config)."""
    from hydra._internal.utils import get_args_parser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict, read_write

    from deit_ablate.config.compose import compose_run_config
    from deit_ablate.config.stage_config import stage_config
    from deit_ablate.core.errors import ConfigError

    args, _ = get_args_parser().parse_known_args(argv)
    if args.cfg not in ("job", "all") or args.multirun or args.config_name or args.config_dir or args.config_path:
        return False
    prepare_configs()
    try:
        cfg = compose_run_config(args.overrides)
    except HydraException:
        return False  # Hydra composes it again and says what is wrong, as for any launch
    if str(cfg.stage) == "pretrain":
        return False
    try:
        shown = stage_config(cfg)
    except ConfigError as error:
        print(f"\nerror: {error}\n", file=sys.stderr)
        sys.exit(2)
    if args.cfg == "job":
        with read_write(shown), open_dict(shown):
            del shown["hydra"]
    package = None if args.package in (None, "_global_") else args.package
    if package is not None:
        shown = OmegaConf.select(shown, package)
        if shown is None:
            print(f"package '{package}' not found in config", file=sys.stderr)
            sys.exit(1)
        print(f"# @package {package}")
    if not OmegaConf.is_config(shown):
        print(shown)
        return True
    if args.resolve:
        shown = OmegaConf.create(OmegaConf.to_container(shown, resolve=True))
    sys.stdout.write(OmegaConf.to_yaml(shown))
    return True
