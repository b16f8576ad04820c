"""Data and metrics of the offline tasks scse_lambada and scse_wikitext (no hub download).

The data file is named by lm-eval's task metadata, which its CLI fills from `--metadata`
(`lambada=PATH`, `wikitext=PATH`), and read with scse-dist's readers, so scse-eval and lm-eval
see the same documents. scse_wikitext follows scse-eval's conventions (the article as in the
file, stripped; words `len(page.split())`), not lm-eval's stock `wikitext`: docs/evaluation.md.
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
