"""What an evaluation task reads, read and checked before any model loads: the task's record
(scse_dist.task_registry), the tokenizer, and the task's data through the record's reader.
Nothing here imports torch until a good shard dir is opened as a stream, so `scse-eval` reports
bad input at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from scse_dist.cli_errors import InputError
from scse_dist.data.config import DataConfig
from scse_dist.model.config import ModelConfig
from scse_dist.task_registry import TASKS, Task, either, unknown_task


def is_shard_dir(path: str) -> bool:
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(path))
    return fs.isfile(root.rstrip("/") + "/index.json")


def check_heldout_shards(path: str, data: DataConfig, model: ModelConfig, tokenizer: Any
                         ) -> None:
    """InputError unless `path` holds held-out shards the model can read: ids within its vocab,
    a heldout split, written with the model's tokenizer."""
    from scse_dist.data.index import check_tokenizer, read_index

    # Shards from a bigger tokenizer would index past the embedding: say so instead of crashing.
    index = read_index(str(path))
    if index["vocab_size"] > model.vocab_size:
        raise InputError(f"{path}: shards were written with vocab_size={index['vocab_size']}, "
                         f"more than the model's model.vocab_size={model.vocab_size}")
    if not index["splits"].get("heldout"):
        raise InputError(f"{path}: index.json lists no heldout shards "
                         "(build shards with data.heldout_fraction > 0)")
    check_tokenizer(str(path), index, tokenizer.sha256, f"the model's ({data.tokenizer})")


def _shard_stream(path: str, data: DataConfig, model: ModelConfig, batch_size: int,
                  tokenizer: Any):
    """The held-out split of the shards at `path` as (B, seq_len + 1) batches, checked first.
    A corrupt sample stops it (max_failures=0): a perplexity without it would be another one."""
    check_heldout_shards(path, data, model, tokenizer)
    from scse_dist.data.stream import TokenStream  # imports torch: only for shards that passed

    return TokenStream(path, split="heldout", seq_len=data.seq_len,
                       batch_size=batch_size, rank=0, world_size=1, seed=0, loop=False,
                       tokenizer_sha256=tokenizer.sha256, max_failures=0)


def load_tokenizer(path: str, data: DataConfig, model: ModelConfig):
    from scse_dist.data.tokenizer import Tokenizer

    # data.tokenizer_kind is the kind of data.tokenizer; another file (--tokenizer) tells its own
    tokenizer = Tokenizer.load(path, data.tokenizer_kind if path == data.tokenizer else "auto")
    if tokenizer.vocab_size > model.vocab_size:
        raise InputError(f"tokenizer {path}: {tokenizer.vocab_size} pieces, more than the model's "
                         f"model.vocab_size={model.vocab_size}")
    return tokenizer


class TaskData(NamedTuple):
    """What a task reads, read and checked: a held-out shard stream, or the tokenizer and the
    documents (heldout/diagnose corpus, wikitext) or passages (lambada)."""

    tokenizer: Any
    inputs: Any
    shards: bool


def get_task(name: str) -> Task:
    """The registry's record of `name` (scse_dist.task_registry), or a ValueError with a
    did-you-mean."""
    if name not in TASKS:
        raise ValueError(f"task: {unknown_task(name)}")
    return TASKS[name]


def no_exit_rule(task: str) -> str:
    """Why `task` takes no exit rule, naming the tasks that do."""
    takes = [name for name, t in TASKS.items() if t.scores_tokens]
    return f"{task} measures the loop at fixed depths; use --exit with {either(takes)}"


def read_task_data(task: str, data_config: DataConfig, model: ModelConfig, batch_size: int,
                   data: str, tokenizer: Any = None) -> TaskData:
    """Open `task`'s data with its record's reader (held-out shards as a stream) with `tokenizer`
    (default data.tokenizer; shards must have been written with it). Bad data fails here."""
    record = get_task(task)
    tokenizer = tokenizer or load_tokenizer(data_config.tokenizer, data_config, model)
    if record.heldout and is_shard_dir(data):
        return TaskData(tokenizer, _shard_stream(data, data_config, model, batch_size, tokenizer),
                        shards=True)
    return TaskData(tokenizer, record.reader(data), shards=False)
