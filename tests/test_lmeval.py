"""lm-evaluation-harness: `scse-lm-eval --model scse` on the offline tasks agrees with scse-eval
on the same files (an independent reading of the data and aggregation of the metrics), without
touching the Hugging Face hub; the exit rule, generation and the CLI's argument handling."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import REPO_ROOT, TINY_VOCAB, console_script, tiny_documents  # noqa: E402
from scse_dist.checkpoint.export import save_exported_model  # noqa: E402
from scse_dist.config import config_from_dict  # noqa: E402
from scse_dist.data.tokenizer import Tokenizer  # noqa: E402
from scse_dist.eval.cli import main as eval_main  # noqa: E402
from scse_dist.lmeval import TASKS_DIR  # noqa: E402
from scse_dist.lmeval.model import ScseLM, exit_scorer  # noqa: E402
from scse_dist.model import LoopedLM  # noqa: E402
from scse_dist.model.exit_rules import parse_exit_rule  # noqa: E402

DEPTH = 2


def _train(cfg, tokenizer: Tokenizer, steps: int = 100) -> LoopedLM:
    """A few AdamW steps on the tiny grammar at fixed depth: enough that LAMBADA's last words
    ("at night.", "with great care.") are mostly the argmax (accuracy 0.875 at depth 2), so
    accuracy is neither 0 nor 1. (~3 s on one quiet core.)"""
    # One thread, subnormals flushed, as conftest's cpu_settings (a per-test fixture, which is
    # not yet active when a module fixture runs): two busy-waiting threads on shared cores made
    # this take minutes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        return _adamw_steps(cfg, tokenizer, steps)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


def _adamw_steps(cfg, tokenizer: Tokenizer, steps: int) -> LoopedLM:
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    stream = []
    for ids in tokenizer.encode_batch(tiny_documents(300, seed=1)):
        stream += [*ids, tokenizer.eos_id]
    seq = cfg.data.seq_len + 1
    rows = torch.tensor([stream[i:i + seq] for i in range(0, len(stream) - seq, seq)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = rows[torch.randint(len(rows), (16,), generator=gen)]
        loss = model(batch[:, :-1], batch[:, 1:], depth=DEPTH, keep_logits=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory, tiny_data):
    """(export dir, LAMBADA JSONL, WikiText raw file) of a briefly trained tiny model."""
    root = tmp_path_factory.mktemp("lmeval")
    cfg = config_from_dict({"name": "tiny",
                            "data": {"seq_len": 32, "tokenizer": tiny_data["tokenizer"]},
                            "eval": {"batch_size": 3},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 32, "depth": DEPTH}})
    model = _train(cfg, Tokenizer.load(tiny_data["tokenizer"]))
    export = save_exported_model(model.state_dict(), cfg, str(root / "export"),
                                 tokenizer=tiny_data["tokenizer"])
    # every third passage is one sentence: most of those fit a window whole, EOS in front; the
    # others are cut from the left (lm-eval's hf model must agree with ours both ways)
    docs = [d if i % 3 else d.split(". ")[-1] for i, d in enumerate(tiny_documents(24, seed=7))]
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    # WikiText raw layout: " = Title = " headings, blank lines of one space, paragraphs
    (root / "wiki.test.raw").write_text("".join(
        f" \n = Article {i} = \n \n {d} \n \n" for i, d in enumerate(tiny_documents(6, seed=8))))
    return Path(export), root / "lambada.jsonl", root / "wiki.test.raw"


def _scse_eval(task: str, export: Path, data: Path, out: Path, exit: str = "") -> dict:
    assert eval_main(["--checkpoint", str(export), "--task", task, "--data", str(data),
                      "--depths", str(DEPTH), "--batch-size", "2", "--out", str(out),
                      *(["--exit", exit] if exit else [])]) == 0
    (row,) = json.loads(out.read_text())["results"]
    return row


def _evaluate(model: str, model_args: str, task: str, data: Path) -> dict:
    """lm-eval's simple_evaluate (what its CLI runs) in this process on one offline task.
    Its task index holds only the package's tasks: indexing lm-eval's ~10k stock task files takes
    ~10-20 s per run (the CLI test above covers the CLI)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    metadata = {task.removeprefix("scse_"): str(data)}
    tasks = TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata=metadata)
    return simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                           batch_size=2, device="cpu", metadata=metadata)


def test_lm_eval_agrees_with_scse_eval(lm_data, tmp_path, user_env):
    export, lambada, wiki = lm_data
    env = dict(user_env, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [*console_script("scse-lm-eval"), "--model", "scse",
         "--model_args", f"pretrained={export},depth={DEPTH},exit=fixed,batch_size=2,device=cpu",
         "--tasks", "scse_lambada,scse_wikitext",
         "--metadata", f"lambada={lambada}", f"wikitext={wiki}", "--output_path", "results"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    lm_lambada, lm_wiki = results["scse_lambada"], results["scse_wikitext"]
    # lm-eval leaves progress to the model: the scse model's line per task (stderr is not a
    # terminal here: one line at the end of each task)
    for task, windows in (("scse_lambada", "24"), ("scse_wikitext", r"\d+")):
        assert re.search(rf"^scse {task} T={DEPTH}: ({windows})/\1 window, [\d.]+ window/s, "
                         r"elapsed \d+:\d\d, ETA 0:00$", out.stderr, re.M), out.stderr[-3000:]

    ours = _scse_eval("lambada", export, lambada, tmp_path / "lambada.json")
    assert ours["examples"] == 24 and 0 < ours["accuracy"] < 1  # a test that can tell them apart
    assert lm_lambada["acc,none"] == ours["accuracy"]
    # lm-eval's LAMBADA perplexity is per passage (exp of the mean target log-likelihood)
    assert lm_lambada["perplexity,none"] == pytest.approx(ours["ppl"], rel=1e-6)

    ours = _scse_eval("wikitext", export, wiki, tmp_path / "wikitext.json")
    assert ours["documents"] == 6
    assert lm_wiki["word_perplexity,none"] == pytest.approx(ours["word_ppl"], rel=1e-6)
    assert lm_wiki["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-6)
    assert lm_wiki["byte_perplexity,none"] == pytest.approx(2 ** ours["bits_per_byte"], rel=1e-6)


def test_exit_model_arg_is_scse_evals_exit(lm_data, tmp_path):
    """exit=RULE scores as scse-eval --exit RULE at the same cap (depth=, or the rule's max=):
    the same accuracy, perplexity and steps used; lm-eval's results JSON carries the steps."""
    export, lambada, _ = lm_data
    for rule in ("motion:0.5", f"kl:0.2,min=2,max={DEPTH + 1}"):
        results = _evaluate("scse", f"pretrained={export},depth={DEPTH},exit={rule}",
                            "scse_lambada", lambada)
        ours = _scse_eval("lambada", export, lambada, tmp_path / f"{rule}.json", exit=rule)
        lm = results["results"]["scse_lambada"]
        assert lm["acc,none"] == ours["accuracy"]
        assert lm["perplexity,none"] == pytest.approx(ours["ppl"], rel=1e-6)
        steps = results["config"]["scse_steps"]["scse_lambada"]
        assert results["config"]["scse_exit"] == steps["exit"] == ours["exit"] == rule
        assert steps["steps_histogram"] == ours["steps_histogram"]
        assert steps["mean_steps"] == ours["mean_steps"]
        low, cap = (1, DEPTH) if rule.startswith("motion") else (2, DEPTH + 1)
        assert low < steps["mean_steps"] < cap  # the rule exits some tokens early, not all


# A task of the user's own, as lm-eval's lambada_openai.yaml writes it: the data file read by
# `datasets` (not the package's reader), context and target split by lm-eval's templates.
USER_LAMBADA_TASK = """task: lambada_user
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}, cache_dir: "{cache}"}}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.mark.slow
def test_users_lambada_task_equals_scse_eval(lm_data, tmp_path):
    """Issue 42: a LAMBADA task YAML of the user's own through lm-eval's simple_evaluate and the
    adapter gives scse-eval's accuracy and ppl: one definition of LAMBADA perplexity, lm-eval's
    (per passage), where scse-eval's ppl was per target token (1.11 against lm-eval's 1.67
    here, 1555 against 3.9e9 on real passages and a tiny vocabulary)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    export, lambada, _ = lm_data
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lambada_user.yaml").write_text(USER_LAMBADA_TASK.format(
        data=lambada, cache=tmp_path / "datasets"))
    results = simple_evaluate(
        model="scse", model_args=f"pretrained={export},depth={DEPTH}", tasks=["lambada_user"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=2, device="cpu")["results"]["lambada_user"]
    ours = _scse_eval("lambada", export, lambada, tmp_path / "lambada.json")
    assert ours["examples"] == 24 and 0 < ours["accuracy"] < 1
    assert ours["target_tokens"] > 24  # targets of several tokens: per token is another number
    assert results["acc,none"] == pytest.approx(ours["accuracy"], rel=1e-4)
    assert results["perplexity,none"] == pytest.approx(ours["ppl"], rel=1e-4)


HF_CHILD = """
import json, sys
import scse_dist.lmeval.model  # registers --model scse
sys.path.insert(0, sys.argv[1])
from test_lmeval import _evaluate
export, lambada, wiki = sys.argv[2:5]
hf = f"pretrained={export},trust_remote_code=True"
out = {"hf": _evaluate("hf", hf, "scse_lambada", lambada)["results"]["scse_lambada"],
       "scse": _evaluate("scse", f"pretrained={export}", "scse_lambada",
                         lambada)["results"]["scse_lambada"],
       "hf_wiki": _evaluate("hf", hf, "scse_wikitext", wiki)["results"]["scse_wikitext"]}
print(json.dumps(out))
"""


def _lm_eval_rolling_word_ppl(export: Path, wiki: Path) -> float:
    """scse_wikitext's word perplexity as lm-eval's hf model computes it, by our scorer: its
    rolling windows (disjoint, max_length tokens each, the last one filled with the preceding
    tokens) over the article's ids as the tokenizer gives them, EOS first, after the prefix
    token EOS: so each article also scores that EOS after EOS."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from scse_dist.checkpoint.loading import load_model
    from scse_dist.data.sources import read_wikitext_articles
    from scse_dist.eval.scoring import Window, score_windows

    tokenizer = Tokenizer.load(str(export / "tokenizer.model"))
    model, cfg = load_model(str(export), device="cpu")
    articles = read_wikitext_articles(str(wiki))
    windows = []
    for article in articles:
        ids = [tokenizer.eos_id, *tokenizer.encode(article.strip())]
        for context, scored in map(make_disjoint_window, get_rolling_token_windows(
                ids, tokenizer.eos_id, cfg.model.max_seq_len, 1)):
            windows.append(Window(context + scored, len(context) - 1))
    (scores,) = score_windows(model, windows, [DEPTH], 2)[1]
    return math.exp(sum(s.nll for s in scores) / sum(len(a.split()) for a in articles))


def test_hf_model_agrees_with_scse_model(lm_data, tmp_path, user_env):
    """Plain lm-eval `--model hf --model_args pretrained=EXPORT,trust_remote_code=True` (the
    export's remote code, at the config's depth) scores LAMBADA as `--model scse` does: lm-eval
    splits and encodes context/continuation itself, EOS first (the tokenizer's BOS), and cuts
    windows to max_length (the config's max_position_embeddings, here data.seq_len)."""
    accelerate = pytest.importorskip(
        "accelerate",
        reason="lm-eval's hf model needs accelerate (pip install 'scse-dist[lm-eval]')")
    export, lambada, wiki = lm_data
    # the accelerate this process imports (it may live outside the venv), and a private HF home
    # for the remote code's module cache
    path = [str(Path(accelerate.__file__).parents[1]), user_env["PYTHONPATH"]]
    env = dict(user_env, PYTHONPATH=os.pathsep.join(path), HF_HOME=str(tmp_path / "hf"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", HF_CHILD, str(Path(__file__).parent),
                          str(export), str(lambada), str(wiki)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    hf, scse = out["hf"], out["scse"]
    assert 0 < scse["acc,none"] < 1
    assert hf["acc,none"] == scse["acc,none"]
    assert hf["perplexity,none"] == pytest.approx(scse["perplexity,none"], rel=1e-6)
    # WikiText differs by lm-eval's rolling-window convention (see _lm_eval_rolling_word_ppl)
    # from scse and scse-eval (overlapping windows, no EOS target); it is exactly that convention
    ours = _scse_eval("wikitext", export, wiki, tmp_path / "wikitext.json")["word_ppl"]
    hf_wiki = out["hf_wiki"]["word_perplexity,none"]
    assert hf_wiki == pytest.approx(_lm_eval_rolling_word_ppl(export, wiki), rel=1e-6)
    assert hf_wiki != pytest.approx(ours, rel=1e-3)


def test_exit_rule_model_arg_is_parsed():
    assert exit_scorer("fixed", 4).rule is None and exit_scorer("fixed", 4).depth == 4
    # lm-eval splits --model_args at commas: min= and max= arrive as model args of their own
    scorer = exit_scorer("motion:0.02", 4, {"min": 2, "max": 8})
    assert scorer.rule == parse_exit_rule("motion:0.02,min=2,max=8") and scorer.depth == 4
    with pytest.raises(ValueError, match="unknown kind 'motoin'"):
        exit_scorer("motoin:0.02", 4)
    with pytest.raises(ValueError, match="unknown model args bogus"):
        exit_scorer("motion:0.02", 4, {"bogus": 1})
    with pytest.raises(ValueError, match="fixed runs `depth` steps; set depth= instead of max="):
        exit_scorer("fixed", 4, {"max": 8})


def test_generate_until_is_greedy_and_stops(lm_data):
    export, _, _ = lm_data
    lm = ScseLM(str(export), depth=str(DEPTH), batch_size="2", device="cpu")
    context = "Story 5. The cat sees the red ball"
    ids = [lm.tokenizer.eos_id, *lm.tokenizer.encode(context)]
    with torch.inference_mode():
        for _ in range(6):  # greedy by hand, recomputed each token
            ids.append(int(lm.model(torch.tensor([ids]), depth=DEPTH).logits[0, -1].argmax()))
    greedy = lm.tokenizer.decode(ids[-6:])
    assert greedy.strip(), greedy
    plain, = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 6}))])
    assert plain == greedy
    stop = greedy.strip()[-1]
    cut, = lm.generate_until([SimpleNamespace(args=(context, {"until": [stop],
                                                              "max_gen_toks": 6}))])
    assert cut == greedy.split(stop, 1)[0] and stop not in cut


def _generate_by_recomputing(lm: ScseLM, context: str, kwargs: dict) -> str:
    """generate_until as it was before the KV cache: every token from a sliding window of the
    last max_length tokens, recomputed (the reference the cached path must equal)."""
    from scse_dist.generate import Sampling, next_tokens

    until, max_new = kwargs.get("until", []), kwargs.get("max_gen_toks", 256)
    sampling = Sampling(kwargs.get("temperature", 1.0), kwargs.get("top_p", 1.0)) \
        if kwargs.get("do_sample") else Sampling()
    generator = torch.Generator().manual_seed(kwargs.get("seed", 0))
    ids, new, text = [lm.eot_token_id, *lm.tokenizer.encode(context)], [], ""
    with torch.inference_mode():
        for _ in range(max_new):
            window = torch.tensor([(ids + new)[-lm.max_length:]])
            token = int(next_tokens(lm.scorer.next_logits(lm.model, window), sampling,
                                    generator)[0])
            if token == lm.eot_token_id:
                break
            new.append(token)
            text = lm.tokenizer.decode(new)
            if any(stop in text for stop in until):
                break
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


@pytest.mark.parametrize("exit", ["fixed", "motion:0.3"])
def test_generate_until_through_the_cache_equals_recomputing(lm_data, exit):
    """Short contexts fit the 32-token window (the cache alone), longer ones outgrow it while
    generating (cache, then sliding), the longest start beyond it (sliding alone); greedy,
    sampled with a seed, and cut at an `until` string: the same text as recomputing per token."""
    export, _, _ = lm_data
    lm = ScseLM(str(export), depth=str(DEPTH), exit=exit, device="cpu")
    short, longer = "The cat sees", "Story 5. The cat sees the red ball"
    longest = " ".join(["The old man likes a green box."] * 3)
    sizes = [len(lm.tokenizer.encode(text)) + 1 for text in (short, longer, longest)]  # + EOS
    assert sizes[0] + 16 <= lm.max_length < sizes[1] + 16 and sizes[1] < lm.max_length < sizes[2]
    cases = [{"until": [], "max_gen_toks": 16}, {"until": ["."], "max_gen_toks": 16},
             {"until": [], "max_gen_toks": 16, "do_sample": True, "temperature": 1.0, "seed": 3}]
    requests = [(context, kwargs) for context in (short, longer, longest) for kwargs in cases]
    got = lm.generate_until([SimpleNamespace(args=r) for r in requests])
    want = [_generate_by_recomputing(lm, *r) for r in requests]
    assert got == want
    assert len({text for text in got if text}) >= 5  # not all empty or alike


def test_model_args_are_checked(lm_data):
    export, _, _ = lm_data
    with pytest.raises(ValueError, match="exit rule 'kl:x': kl needs a numeric threshold"):
        ScseLM(str(export), exit="kl:x", device="cpu")
    with pytest.raises(ValueError, match=r"depth='0': expected a positive integer"):
        ScseLM(str(export), depth="0", device="cpu")
    with pytest.raises(ValueError, match="max_length=33 exceeds the model's max_seq_len=32"):
        ScseLM(str(export), max_length="33", device="cpu")


def test_task_files_are_package_data():
    """The tasks lm-eval reads from the installed package are listed in pyproject's package-data."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    patterns = data["scse_dist.lmeval"]
    shipped = {p.name for p in Path(TASKS_DIR).iterdir() if p.suffix in (".yaml", ".py")}
    assert shipped == {"scse_lambada.yaml", "scse_wikitext.yaml", "scse_tasks.py"}
    assert all(any(Path("tasks", name).match(p) for p in patterns) for name in shipped)
