"""`scse-lm-eval`'s own arguments: model args lm-eval's CLI passes itself, the model the
arguments run, its --help (the model, its args, the package's tasks), and an unknown task refused
in one line before lm-eval starts (with the scan of task names that decides it)."""

import inspect
import re
import subprocess

import pytest

pytest.importorskip("lm_eval")

from conftest import console_script, run_profiling_imports  # noqa: E402
from scse_dist.lmeval import TASKS_DIR  # noqa: E402
from scse_dist.lmeval.cli import hoist_model_args, model_named, option_values  # noqa: E402
from scse_dist.lmeval.model import ScseLM  # noqa: E402
from scse_dist.lmeval.task_names import (  # noqa: E402
    lm_eval_tasks_dir,
    task_names,
    unknown_tasks,
)


def test_model_args_batch_size_and_device_become_cli_flags():
    # lm-eval's CLI passes --batch_size/--device to every model; the same names in --model_args
    # would be a duplicate keyword
    assert hoist_model_args(["--model", "scse", "--model_args",
                             "pretrained=/m,batch_size=8,depth=4,device=cpu", "--tasks", "t"]) == \
        ["--model", "scse", "--model_args", "pretrained=/m,depth=4", "--tasks", "t",
         "--batch_size", "8", "--device", "cpu"]
    assert hoist_model_args(["--model_args=pretrained=/m"]) == ["--model_args", "pretrained=/m"]


def test_the_model_the_arguments_run():
    # registering scse (and threads for any model) imports torch: `--help` and `ls tasks` skip it
    for args in (["--model", "scse"], ["run", "--model=scse", "--tasks", "t"], ["-M", "scse"]):
        assert model_named(args) == "scse", args
    assert model_named(["--tasks", "scse", "--model", "hf"]) == "hf"
    for args in (["--help"], ["ls", "tasks"], ["--tasks", "scse"], ["-M"]):
        assert model_named(args) is None, args
    assert option_values(["--tasks", "a", "b,c", "-t", "d", "--tasks=e", "--model", "scse"],
                         ("--tasks", "-t")) == ["a", "b,c", "d", "e"]


def test_help_names_the_model_its_args_and_the_tasks(user_env, tmp_path):
    run = subprocess.run([*console_script("scse-lm-eval"), "--help"], cwd=tmp_path, env=user_env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ours, _, lm_evals = run.stdout.partition("usage: lm-eval")
    assert "--model scse --model_args pretrained=EXPORT" in ours and "--tasks" in lm_evals
    args = set(inspect.signature(ScseLM).parameters) - {"max_batch_size", "exit_options"}
    assert args == {"pretrained", "depth", "exit", "batch_size", "max_length", "stride",
                    "device"}
    shipped = task_names([TASKS_DIR])
    assert shipped == {"scse_lambada", "scse_wikitext"}
    for name in args | shipped:
        assert re.search(rf"^    {name} ", ours, re.M), name


def test_an_unknown_task_is_one_line_before_lm_eval_starts(user_env, tmp_path):
    run = run_profiling_imports(
        [*console_script("scse-lm-eval"), "--model", "scse", "--model_args", "pretrained=nowhere",
         "--tasks", "scse_lambda,hellaswag"], user_env, cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("scse-lm-eval: unknown task 'scse_lambda' (did you mean "
                          "'scse_lambada'?); this package's: scse_lambada, scse_wikitext "
                          "(`scse-lm-eval --help`), lm-eval's: `scse-lm-eval ls tasks`\n")
    assert not {"lm_eval", "torch", "datasets"} & run.imported
    assert list(tmp_path.iterdir()) == []


def test_task_names_accept_patterns_files_and_dirs(tmp_path):
    known = task_names([TASKS_DIR])
    assert unknown_tasks(["scse_*", "scse_lambada", str(tmp_path), "mine.yaml", "lambada"],
                         known) == ["lambada"]
    # a user's task dir: a task, a group of tasks, tags in either YAML form, an include file
    (tmp_path / "a.yaml").write_text("task: bar\ntag:\n  - t1\n  - 't2'\n")
    (tmp_path / "g.yaml").write_text('"group": grp\ntask: [bar]\n')
    (tmp_path / "_template_yaml").write_text("tag: [t3, t4]  # comment\n")
    assert task_names([str(tmp_path)]) == {"bar", "t1", "t2", "grp", "t3", "t4"}


@pytest.mark.slow
def test_task_names_hold_every_name_lm_eval_indexes():
    """The line scan finds every task, group and tag lm-eval's own index finds (so no task
    lm-eval runs is refused), in the installed lm-eval's tasks and the package's."""
    from lm_eval.tasks import TaskManager

    indexed = set(TaskManager(include_path=TASKS_DIR).all_tasks)
    assert len(indexed) > 1000 and {"scse_lambada", "hellaswag"} <= indexed
    assert indexed <= task_names([lm_eval_tasks_dir(), TASKS_DIR])
