"""Hugging Face `transformers` remote code for an export: `write_hf_files(out_dir, ...)`.

An export then loads with `AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)`
(and AutoConfig, AutoTokenizer) without scse-dist. The export dir gets config.json,
tokenizer_config.json (with a tokenizer), the remote code beside this file (REMOTE_CODE) and the
model package's modules, copied verbatim and flat: transformers' dynamic-module loader copies a
remote file's relative imports by the regex `from .NAME import` to `NAME.py` beside it, so a
subpackage fails. The remote-code files therefore run only in an export. Nothing here imports
transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any, Optional

from scse_dist.atomic import atomic_write
from scse_dist.model.config import ModelConfig

HERE = Path(__file__).parent
MODEL_PACKAGE = HERE.parent / "model"
REMOTE_CODE = ("configuration_scse.py", "modeling_scse.py", "tokenization_scse.py",
               "tokenization_scse_base.py", "tokenization_scse_fast.py",
               "tokenization_scse_tiktoken.py")
# AutoTokenizer's (slow, fast) classes for each tokenizer kind (scse_dist.data.tokenizer).
TOKENIZER_CLASSES = {"sentencepiece": ["tokenization_scse.ScseTokenizer", None],
                     "hf": [None, "tokenization_scse_fast.ScseTokenizerFast"],
                     "tiktoken": ["tokenization_scse_tiktoken.ScseTiktokenTokenizer", None]}
HF_CONFIG_NAME = "config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


def model_package_modules() -> list[Path]:
    """The model package's modules copied into an export (all but __init__.py)."""
    modules = sorted(p for p in MODEL_PACKAGE.glob("*.py") if p.name != "__init__.py")
    clash = sorted({p.name for p in modules} & set(REMOTE_CODE))
    assert not clash, f"model package modules clash with the remote-code files: {clash}"
    return modules


def hf_config(model: ModelConfig, tokenizer: Optional[dict[str, Any]]) -> dict:
    """config.json's content. tokenizer: its kind and Tokenizer.special_ids ({"kind", "eos",
    "eos_token", ...}), or None for an export without one (then no AutoTokenizer)."""
    auto_map: dict[str, Any] = {"AutoConfig": "configuration_scse.ScseConfig",
                                "AutoModelForCausalLM": "modeling_scse.ScseForCausalLM"}
    config = {"model_type": "scse", "architectures": ["ScseForCausalLM"], "auto_map": auto_map,
              **dataclasses.asdict(model), "dtype": "float32", "use_cache": True,
              "tie_word_embeddings": False}
    if tokenizer is not None:
        auto_map["AutoTokenizer"] = TOKENIZER_CLASSES[tokenizer["kind"]]
        eos = tokenizer["eos"]
        # Documents start after an EOS (tokenization_scse.py), so it is also the BOS; and the pad.
        config.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                      scse_tokenizer_kind=tokenizer["kind"])
    return config


def write_hf_files(out_dir: str | Path, model: ModelConfig,
                   tokenizer: Optional[dict[str, Any]] = None) -> None:
    """Write config.json (and, with a tokenizer, tokenizer_config.json), the remote code and the
    model package's modules into `out_dir` (each file atomically)."""
    out = Path(out_dir)
    for src in [HERE / name for name in REMOTE_CODE] + model_package_modules():
        atomic_write(out / src.name, functools.partial(shutil.copyfile, src))
    config = hf_config(model, tokenizer)
    atomic_write(out / HF_CONFIG_NAME,
                 lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    if tokenizer is not None:
        classes = TOKENIZER_CLASSES[tokenizer["kind"]]
        tokenizer_config = {"tokenizer_class": next(c for c in classes if c).split(".")[1],
                            "auto_map": {"AutoTokenizer": classes},
                            "scse_tokenizer_kind": tokenizer["kind"]}
        # EOS is the BOS and the pad too (hf_config); a tokenizer.json names none itself
        tokenizer_config.update({f"{name}_token": tokenizer["eos_token"]
                                 for name in ("eos", "bos", "pad")})
        if tokenizer["kind"] == "hf":  # ScseTokenizerFast has no __init__ to set them
            tokenizer_config.update(padding_side="left", split_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
        atomic_write(out / TOKENIZER_CONFIG_NAME,
                     lambda p: p.write_text(json.dumps(tokenizer_config, indent=2) + "\n"))


def hf_file_names(with_tokenizer: bool) -> list[str]:
    """The names write_hf_files adds to an export."""
    names = [HF_CONFIG_NAME, *REMOTE_CODE, *(p.name for p in model_package_modules())]
    return sorted(names + ([TOKENIZER_CONFIG_NAME] if with_tokenizer else []))
