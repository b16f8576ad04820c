"""Exported model I/O: `model.safetensors` (fp32 weights), `config.yaml` (the resolved RunConfig),
the run's tokenizer and the Hugging Face remote code (scse_dist/hf); docs/checkpoints.md, "The
export". Its config's `data.tokenizer` is a bare name resolved against the export's own directory,
so a copy works wherever it lies. Tied weights are saved once (safetensors refuses shared storage):
the dropped names go into the file's metadata, and the model re-ties them on construction.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from safetensors import SafetensorError

from scse_dist.atomic import atomic_write, output_dir
from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig, load_saved_config, save_config
from scse_dist.data.config import TOKENIZER_EXPORT_NAMES as EXPORT_NAMES
from scse_dist.run_dir import CONFIG_NAME, WEIGHTS_NAME

if TYPE_CHECKING:  # torch is imported where weights are read or written: a command that only
    # reads an export's config (or rejects a bad path) answers without it
    import torch

    from scse_dist.data.tokenizer import Tokenizer
    from scse_dist.model import LoopedLM

# Every file an export's tokenizer may be (the kinds' names, tiktoken's settings beside its ranks).
TOKENIZER_FILES = (*EXPORT_NAMES.values(), EXPORT_NAMES["tiktoken"] + ".json")
# safetensors metadata key: JSON {dropped_name: kept_name} for tensors that shared storage.
_ALIASES_KEY = "scse_tied_aliases"
# Wrappers that prefix parameter names (DeepSpeed engine, torch.compile); stripped on save.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _save_canonical(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """save_file, then its metadata's keys sorted in place (safetensors writes them in hash-map
    order, which differs between processes): the same weights give the same bytes."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        canonical = json.dumps(header, separators=(",", ":")).encode()
        # the same keys and values: never longer; pad as safetensors does
        if len(canonical) <= size:
            f.seek(8)
            f.write(canonical.ljust(size, b" "))


def _strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in _WRAPPER_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def _dedupe_shared(state_dict: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep the first name of each group of tensors that are views of the same memory."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor
    return kept, aliases


def save_exported_model(state_dict: dict[str, torch.Tensor], cfg: RunConfig, out_dir: str,
                        tokenizer: Union[str, "Tokenizer", None] = None,
                        after_weights: Optional[Callable[[], None]] = None) -> str:
    """Write `out_dir/model.safetensors` (fp32, contiguous, ties saved once), `config.yaml`, the
    Hugging Face files and, given a `tokenizer` (loaded, or a path or URL), its files under the
    kind's names, which the saved config's data.tokenizer then names. Written beside `out_dir` and
    moved in, model.safetensors last (atomic.output_dir): a failed export leaves `out_dir` as it
    was. `after_weights` runs once the weights are written (the fault suite). Returns `out_dir`.
    """
    from scse_dist.hf import write_hf_files

    loaded = None if isinstance(tokenizer, str) else tokenizer
    if isinstance(tokenizer, str):  # read first: a bad tokenizer fails before anything is written
        from scse_dist.data.tokenizer import Tokenizer

        loaded = Tokenizer.load(tokenizer, cfg.data.tokenizer_kind
                                if tokenizer == cfg.data.tokenizer else "auto")
    state_dict = _strip_wrapper_prefixes(dict(state_dict))
    kept, aliases = _dedupe_shared(state_dict)
    tensors = {
        name: (t.detach().float() if t.is_floating_point() else t.detach()).cpu().contiguous()
        for name, t in kept.items()
    }
    # Distinct tensors may still be views into one storage (e.g. slices of a fused buffer), which
    # safetensors also refuses: give those their own copy.
    storages = collections.Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    tensors = {n: t.clone() if t.numel() and storages[t.untyped_storage().data_ptr()] > 1 else t
               for n, t in tensors.items()}
    metadata = {"format": "pt", _ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    def made_here(url: str) -> bool:  # an export (it has weights) is replaced; other files stay
        return (Path(url) / WEIGHTS_NAME).is_file()

    with output_dir(str(out_dir), made_here, WEIGHTS_NAME) as tmp:
        out = Path(tmp)
        atomic_write(out / WEIGHTS_NAME, lambda p: _save_canonical(tensors, p, metadata))
        if after_weights is not None:
            after_weights()
        if loaded is not None:
            files = loaded.export_files()
            for name, data in files.items():
                atomic_write(out / name, lambda p: p.write_bytes(data))
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                cfg.data, tokenizer=next(iter(files)), tokenizer_kind=loaded.kind))
        atomic_write(out / CONFIG_NAME, lambda p: save_config(cfg, p))
        write_hf_files(out, cfg.model, None if loaded is None
                       else {"kind": loaded.kind, **loaded.special_ids()})
    return str(Path(out_dir))


def not_an_export(directory: Path) -> Optional[str]:
    """Why `directory` is not an export dir (it does not exist, is a file, or holds no weights);
    None when it holds model.safetensors."""
    if not directory.exists():
        return f"exported model directory {str(directory)!r} does not exist"
    if not directory.is_dir():
        return f"{str(directory)!r} is a file, not an export directory"
    if not (directory / WEIGHTS_NAME).is_file():
        return (f"{str(directory)!r} is a directory but not an export: it has no {WEIGHTS_NAME} "
                f"(an export holds {WEIGHTS_NAME} and {CONFIG_NAME})")
    return None


def _resolve_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    p = Path(path)
    weights = p if p.suffix == ".safetensors" else p / WEIGHTS_NAME
    config = weights.parent / CONFIG_NAME
    reason = not_an_export(p) if p.suffix != ".safetensors" else None
    if reason:
        raise FileNotFoundError(reason)
    for f in (weights, config):
        if not f.is_file():
            raise FileNotFoundError(f"exported model file {str(f)!r} is missing "
                                    f"(an export holds {WEIGHTS_NAME} and {CONFIG_NAME})")
    return weights, config


def load_export_config(path: str | os.PathLike) -> RunConfig:
    """The RunConfig of an export (its dir or its .safetensors file), data.tokenizer resolved: a
    bare name such as `tokenizer.model` means the export's own copy."""
    _, config = _resolve_paths(path)
    cfg = load_saved_config(config)  # ConfigError (a ValueError) names config.yaml if invalid
    if cfg.data.tokenizer in TOKENIZER_FILES:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, tokenizer=str(config.parent / cfg.data.tokenizer)))
    return cfg


LOCAL_PROTOCOLS = {"file", "local"}


def is_remote(url: str | os.PathLike) -> bool:
    """Whether `url` names remote storage (s3://, gs://, memory://, ...): the one check of the
    package; a plain path and file:// are local."""
    import fsspec

    protocol = fsspec.core.split_protocol(str(url))[0] or "file"
    return protocol not in LOCAL_PROTOCOLS


@contextlib.contextmanager
def fetched(url: str, names: Sequence[str], required: Sequence[str]) -> Iterator[str]:
    """A temporary local dir holding the files `names` of the remote dir `url`; a missing
    `required` file is a FileNotFoundError naming it, any other fsspec failure an OSError."""
    import fsspec

    url = url.rstrip("/")
    with tempfile.TemporaryDirectory(prefix="scse-fetched-") as tmp:
        try:
            fs, root = fsspec.core.url_to_fs(url)
            for name in names:
                if fs.isfile(f"{root}/{name}"):
                    fs.get_file(f"{root}/{name}", os.path.join(tmp, name))
                elif name in required:
                    raise FileNotFoundError(f"{url}/{name} is missing")
        except FileNotFoundError:
            raise
        except Exception as exc:  # only fsspec runs here
            raise OSError(f"{url} cannot be read: {type(exc).__name__}: {exc}") from exc
        yield tmp


@contextlib.contextmanager
def local_export(path: str | os.PathLike) -> Iterator[str]:
    """`path` itself when it is local; an export dir given as a remote fsspec URL (s3://,
    memory://, ...) is copied to a temporary dir for the duration of the `with`."""
    if not is_remote(path):
        import fsspec

        yield fsspec.core.strip_protocol(str(path)) if "://" in str(path) else str(path)
        return
    try:
        # exports made before the tokenizer went along lack it
        with fetched(str(path), (WEIGHTS_NAME, CONFIG_NAME, *TOKENIZER_FILES),
                     required=(WEIGHTS_NAME, CONFIG_NAME)) as tmp:
            yield tmp
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"exported model file {exc} (an export holds {WEIGHTS_NAME} and "
                                f"{CONFIG_NAME})") from None
    except OSError as exc:
        raise OSError(f"export {exc}") from None


def read_export_weights(weights: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of an export's model.safetensors, tied aliases restored (InputError if
    unreadable)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights = str(weights)
    try:
        state = load_file(weights)
        with safe_open(weights, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    except (SafetensorError, OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{weights!r} is not a readable safetensors export: {exc}") from None
    for alias, source in aliases.items():
        if source not in state:
            raise InputError(f"{weights!r}: tied alias {alias!r} points at missing {source!r}")
        state[alias] = state[source]
    return state


def weights_mismatch(expected: dict[str, torch.Tensor],
                     state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """What keeps `state` from loading into a model whose state dict is `expected`: the keys
    "missing", "unexpected" and "shape mismatch" (only non-empty lists; {} when it fits)."""
    problems = {
        "missing": sorted(set(expected) - set(state)),
        "unexpected": sorted(set(state) - set(expected)),
        "shape mismatch": sorted(f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                                 for k, v in expected.items()
                                 if k in state and state[k].shape != v.shape),
    }
    return {label: items for label, items in problems.items() if items}


def describe_mismatch(problems: dict[str, list[str]], show: int = 5) -> str:
    """weights_mismatch's result on one line, at most `show` names per kind."""
    return "; ".join(f"{label}: {', '.join(items[:show])}"
                     + (f" (+{len(items) - show} more)" if len(items) > show else "")
                     for label, items in problems.items())


def load_exported_model(path: str | os.PathLike, device: str | torch.device = "cpu"
                        ) -> tuple["LoopedLM", RunConfig]:
    """Load an export (its directory, or its .safetensors file beside config.yaml), strictly: the
    model in eval mode on `device` and its RunConfig. FileNotFoundError when a file is missing,
    InputError naming both files when the weights do not fit the config."""
    from scse_dist.model import LoopedLM

    weights, config = _resolve_paths(path)
    cfg = load_export_config(path)
    state = read_export_weights(weights)
    model = LoopedLM(cfg.model)
    problems = weights_mismatch(model.state_dict(), state)
    if problems:
        raise InputError(f"weights {str(weights)!r} do not match the model built from "
                         f"{str(config)!r}; {describe_mismatch(problems)}")
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), cfg
