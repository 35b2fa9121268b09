"""Train one run of the DeiT recipe: `python train.py [group=option ...] [key=value ...]` (see README)."""

import sys

import hydra
from omegaconf import DictConfig

from deit_ablate.config import register_configs
from deit_ablate.errors import ConfigError, RunError
from deit_ablate.identity import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from deit_ablate.run import discard_empty_run_dir, run

    try:
        run(cfg)
    except (ConfigError, RunError) as error:
        discard_empty_run_dir()
        print(f"\nerror: {error}\n", file=sys.stderr)
        sys.exit(2 if isinstance(error, ConfigError) else 1)


if __name__ == "__main__":
    main()
