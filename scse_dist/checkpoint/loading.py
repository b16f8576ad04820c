"""Load a model to evaluate from an export (its dir or .safetensors file) or a DeepSpeed checkpoint:
a run dir, its `checkpoints/` dir (the `latest` tag) or one tag dir, the weights consolidated to
fp32 from any ZeRO stage and the config the tag's `config.json` (else the run's `config.yaml`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig, load_saved_config
from scse_dist.run_dir import CONFIG_NAME, WEIGHTS_NAME, RunDir
from scse_dist.typed_yaml import ConfigError

if TYPE_CHECKING:  # imported where weights load: a bad path is reported without it
    import torch

    from scse_dist.model import LoopedLM


def _deepspeed_location(path: Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for a run dir, a checkpoints dir or a tag dir."""
    if RunDir(path).checkpoints.is_dir():
        path = RunDir(path).checkpoints
    if (path / "latest").is_file():
        return path, (path / "latest").read_text().strip()
    if list(path.glob("mp_rank_*_model_states.pt")):
        return path.parent, path.name
    raise FileNotFoundError(f"{str(path)!r} is neither an export (model.safetensors + config.yaml) "
                            "nor a DeepSpeed checkpoint dir (a 'latest' file or "
                            "mp_rank_00_model_states.pt)")


def checkpoint_weights(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of DeepSpeed checkpoint `tag` under `root` (verified), engine prefixes
    stripped."""
    from scse_dist.checkpoint.export import _strip_wrapper_prefixes
    from scse_dist.checkpoint.manifest import verify_tag
    from scse_dist.checkpoint.zero_weights import fp32_state_dict

    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{str(root)!r}: checkpoint tag {tag!r} does not exist")
    status = verify_tag(tag_dir)  # a changed byte loads as other weights: refuse, as a resume does
    if not status.intact:
        raise InputError(f"checkpoint {str(tag_dir)!r}: {status.problem} (`scse-ckpt list` shows "
                         "the intact tags)")
    return _strip_wrapper_prefixes(fp32_state_dict(root=root, tag=tag))


def _is_export(p: Path) -> bool:
    return p.suffix == ".safetensors" or (p / WEIGHTS_NAME).is_file()


def deepspeed_checkpoint(path: str | os.PathLike) -> tuple[Path, str, Path]:
    """(checkpoints root, tag, config file) of a run dir, its checkpoints/ dir or one tag dir."""
    from scse_dist.checkpoint.manifest import CONFIG_NAME as TAG_CONFIG_NAME

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist")
    root, tag = _deepspeed_location(p)
    for config in (root / tag / TAG_CONFIG_NAME, root.parent / CONFIG_NAME):
        if config.is_file():
            return root, tag, config
    raise FileNotFoundError(f"{str(root / tag)!r}: no {TAG_CONFIG_NAME} in the tag and the run's "
                            f"{CONFIG_NAME} is missing at {str(root.parent / CONFIG_NAME)!r}")


def checkpoint_config(path: str | os.PathLike) -> RunConfig:
    """The RunConfig of an export or a DeepSpeed checkpoint, without loading any weights."""
    from scse_dist.checkpoint.export import load_export_config

    if _is_export(Path(path)):
        return load_export_config(path)
    return load_saved_config(deepspeed_checkpoint(path)[2])


def device_flag(name: str) -> str:
    """`--device NAME` as given, once torch can place a tensor there; else ConfigError (exit 2):
    an unknown device string, or a CUDA device on a machine without one."""
    if name == "cpu":  # always there: a bad checkpoint path is still found before torch loads
        return name
    import torch

    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as exc:  # torch's own message, e.g. "not compiled with"
        raise ConfigError(f"--device {name!r}: {exc}") from None
    return name


def load_model(path: str | os.PathLike, device: str = "cpu") -> tuple[LoopedLM, RunConfig]:
    """The model (eval mode, on `device`) and its RunConfig from an export or a DeepSpeed
    checkpoint."""
    from scse_dist.checkpoint.export import load_exported_model

    p = Path(path)
    if _is_export(p):
        return load_exported_model(p, device=device)
    root, tag, config = deepspeed_checkpoint(p)  # a bad path fails here, before torch loads
    cfg = load_saved_config(config)
    from scse_dist.model import LoopedLM

    model = LoopedLM(cfg.model)
    state = checkpoint_weights(root, tag)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise InputError(f"checkpoint {str(root / tag)!r} does not match {str(config)!r}: "
                         f"{exc}") from None
    return model.to(device).eval(), cfg
