"""scse-eval reads LAMBADA as lm-eval's official task does: the installed lm_eval package's own
task YAML (lambada_openai.yaml, its Jinja templates rendered by lm-eval) splits the same
passages, newlines included, into the same context and target as scse_dist.data.sources."""

import json
import re
from pathlib import Path

import pytest
import yaml

from scse_dist.eval.tasks.lambada import read_lambada

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.utils import apply_template  # noqa: E402

# Passages the whitespace split got wrong: a blank line or a newline before the last word, a
# newline inside the context, a tab, and two spaces (an empty word in the context).
TRICKY = ["he looked at the door .\n\nmarcus",
          "she said , `` come here . ''\nthe dog ran to her",
          "line one\nline two and\tthe last\tword",
          "a  double space before the end",
          "plain passage with its last word"]


def _official_task(name: str) -> dict:
    path = Path(lm_eval.__file__).parent / "tasks" / "lambada" / f"{name}.yaml"
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("task", ["lambada_openai", "lambada_standard"])
def test_lambada_split_equals_lm_eval_official_task(tmp_path, task):
    spec = _official_task(task)
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TRICKY))
    passages = read_lambada(str(path))
    expected = [(apply_template(spec["doc_to_text"], {"text": t}),
                 apply_template(spec["doc_to_target"], {"text": t})) for t in TRICKY]
    assert [tuple(p) for p in passages] == expected
    # the cases the old whitespace split moved: the newline stays in the target
    assert passages[0].target == " .\n\nmarcus" and passages[0].context == "he looked at the door"
    assert passages[2].target == " last\tword"


def test_lambada_plain_text_lines_split_at_the_last_space(tmp_path):
    path = tmp_path / "lambada_development_plain_text.txt"
    path.write_text("a b c  \nx y\tz\r\n")
    assert [tuple(p) for p in read_lambada(str(path))] == [("a b", " c"), ("x", " y\tz")]


@pytest.mark.parametrize("text, message", [
    ("lonely", "passage has no context before its last word: 'lonely'"),
    ("\nnew\nlines", "passage has no context before its last word"),
    ("a b ", "passage has no word after its last space: 'a b'"),
])
def test_lambada_passage_without_a_split_is_one_line(tmp_path, text, message):
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps({"text": "fine passage"}) + "\n" + json.dumps({"text": text}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
        read_lambada(str(path))


WIKI = (" \n = Robert Boulter = \n \n Robert Boulter is an English film and television actor . "
        "He had a guest @-@ starring role in 2000 , at 1 @,@ 000 m . \n \n"
        " = Du Fu = \n \n Du Fu ( 712 – 770 ) was a prominent Chinese poet . \n")


def test_wikitext_counts_against_lm_eval_wikitext_task(tmp_path):
    """The conventions docs/evaluation.md states, checked against lm-eval's own `wikitext` task
    code: the same bytes per article; words by str.split(), which is lm-eval's count less one for
    the leading and one for the trailing whitespace of an article; and scse-eval scores the raw
    text where lm-eval first detokenizes it (" @-@ " -> "-", " , " -> ", ")."""
    from lm_eval.tasks.wikitext import preprocess_wikitext as stock

    from scse_dist.data.sources import read_wikitext_articles

    path = tmp_path / "wiki.test.raw"
    path.write_text(WIKI)
    articles = read_wikitext_articles(str(path))
    assert len(articles) == 2
    for page in articles:
        counts = stock.process_results({"page": page}, [-1.0])
        edges = int(page[0].isspace()) + int(page[-1].isspace())
        assert edges == 2  # every article begins with " " and ends with "\n"
        assert counts["word_perplexity"][1] == len(page.split()) + edges
        assert counts["bits_per_byte"][1] == len(page.encode("utf-8"))
    detokenized = stock.wikitext_detokenizer({"page": articles[0]})
    assert "guest-starring" in detokenized and "1,000" in detokenized
    assert "guest @-@ starring" in articles[0].strip()  # what scse-eval scores
