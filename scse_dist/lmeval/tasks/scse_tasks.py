"""Data and metrics of the offline tasks scse_lambada and scse_wikitext (no hub download).

The data file is named by lm-eval's task metadata, which its CLI fills from `--metadata`:
    --metadata lambada=PATH     (scse_lambada)
    --metadata wikitext=PATH    (scse_wikitext)
Files are read with scse-dist's readers (the formats scse-eval reads), so both tools see the same
documents.

scse_wikitext follows scse-eval's conventions, which differ from lm-eval's stock `wikitext` task:
- the article is scored as it is in the file (stripped of surrounding whitespace); the stock task
  first undoes WikiText's tokenization (" @-@ " -> "-", " , " -> ", ", ...);
- words are `len(page.split())`; the stock task counts `len(re.split(r"\\s+", page))`, which adds
  one for leading and one for trailing whitespace (every article ends with a newline);
- bytes are the UTF-8 bytes of the article as in the file, as in the stock task.
word_perplexity = exp(-sum loglikelihood / sum words) and bits_per_byte = -sum loglikelihood /
ln 2 / sum bytes aggregate over articles, like scse-eval's word_ppl and bits_per_byte.
"""

from __future__ import annotations

import datasets


def _path(metadata: dict, key: str, task: str) -> str:
    path = metadata.get(key)
    if not path:
        raise ValueError(f"{task}: name the data file with --metadata {key}=PATH "
                         f"(lm-eval's task metadata {key!r})")
    return str(path)


def load_lambada(**metadata) -> datasets.DatasetDict:
    from scse_dist.eval.tasks.lambada import read_lambada

    passages = read_lambada(_path(metadata, "lambada", "scse_lambada"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [{"context": p.context, "target": p.target} for p in passages])})


def lambada_context(doc: dict) -> str:
    return doc["context"]


def lambada_target(doc: dict) -> str:
    return doc["target"]


def load_wikitext(**metadata) -> datasets.DatasetDict:
    from scse_dist.data.sources import read_wikitext_articles

    pages = read_wikitext_articles(_path(metadata, "wikitext", "scse_wikitext"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": p} for p in pages])})


def wikitext_target(doc: dict) -> str:
    return doc["page"].strip()


def wikitext_results(doc: dict, results: list) -> dict:
    (loglikelihood,) = results
    words = len(doc["page"].split())
    n_bytes = len(doc["page"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}
