"""`scse-lm-eval`: lm-eval's own CLI (every lm_eval option works) with the model `scse` (an
scse-dist export) and this package's offline tasks.

    scse-lm-eval --model scse --model_args pretrained=EXPORT,depth=8 \\
                 --tasks scse_lambada --metadata lambada=lambada_test.jsonl

model `scse`, its --model_args (comma-separated; all but pretrained optional):
    pretrained   export dir (model.safetensors, config.yaml, the tokenizer), a path or an fsspec
                 URL, or a DeepSpeed checkpoint dir (as scse-eval --checkpoint)
    depth        loop depth T; default the config's model.depth
    exit         exit rule as scse-eval --exit takes it: fixed (every token runs T steps),
                 kl:TAU or motion:TAU, optionally ,min=N,max=N (the cap: max, else depth)
    batch_size   windows per forward; default the config's eval.batch_size
    max_length   tokens per window; default the config's data.seq_len
    stride       loglikelihood_rolling's sliding-window stride; default max_length // 2
    device       cpu, cuda, cuda:1, ...; default cuda when there is one

tasks (offline: each reads the local file --metadata names, any fsspec URL; found without
--include_path, which replaces them):
    scse_lambada   LAMBADA, OpenAI JSONL or one passage per line: --metadata lambada=PATH;
                   acc and perplexity (per passage), as scse-eval --task lambada
    scse_wikitext  WikiText raw (wiki.test.raw): --metadata wikitext=PATH; word_perplexity,
                   byte_perplexity, bits_per_byte, as scse-eval --task wikitext
lm-eval's own tasks (`scse-lm-eval ls tasks`) download their data from the Hugging Face hub.

An unknown --tasks name is one line and exit status 2, before lm-eval starts.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional, Sequence

from scse_dist.lmeval import MODEL_NAME, TASKS_DIR
from scse_dist.lmeval.task_names import did_you_mean, lm_eval_tasks_dir, task_names, unknown_tasks

HOISTED = ("batch_size", "device")  # model args that lm-eval's CLI passes itself


def model_named(args: Sequence[str]) -> Optional[str]:
    """The model the arguments select (`--model NAME`, `--model=NAME`, `-M NAME`); None when they
    run none (`--help`, `ls tasks`)."""
    values = option_values(args, ("--model", "-M"))
    return values[-1] if values else None


def option_values(args: Sequence[str], flags: tuple[str, ...]) -> list[str]:
    """The values given to an option (`--tasks a b`, `--tasks=a`, `-t a`), in order."""
    values: list[str] = []
    taking = False
    for arg in args:
        if arg.startswith("-"):
            flag, eq, value = arg.partition("=")
            taking = flag in flags and not eq
            if flag in flags and eq:
                values.append(value)
        elif taking:
            values.append(arg)
    return values


def hoist_model_args(args: list[str]) -> list[str]:
    """`--model_args a=1,batch_size=8,device=cpu` -> `--model_args a=1 --batch_size 8 --device
    cpu`."""
    out: list[str] = []
    hoisted: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--model_args", "-a") and i + 1 < len(args):
            flag, value, i = arg, args[i + 1], i + 2
        elif arg.startswith("--model_args="):
            flag, value, i = "--model_args", arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        kept = []
        for item in value.split(","):
            key = item.split("=", 1)[0].strip()
            if key in HOISTED and "=" in item:
                hoisted += [f"--{key}", item.split("=", 1)[1]]
            else:
                kept.append(item)
        if kept:
            out += [flag, ",".join(kept)]
    return out + hoisted


def refused_tasks(args: Sequence[str]) -> Optional[str]:
    """The line refusing the --tasks names that lm-eval would not find (in its own tasks and the
    --include_path dir, else this package's), or None."""
    tasks = [t for value in option_values(args, ("--tasks", "-t")) for t in value.split(",") if t]
    if not tasks:
        return None
    ours = option_values(args, ("--include_path",)) or [TASKS_DIR]
    known = task_names([d for d in (lm_eval_tasks_dir(), *ours) if d])
    unknown = unknown_tasks(tasks, known)
    if not unknown:
        return None
    names = ", ".join(f"{t!r}{did_you_mean(t, known)}" for t in unknown)
    return (f"scse-lm-eval: unknown task{'s' if len(unknown) > 1 else ''} {names}; this "
            f"package's: {', '.join(sorted(task_names([TASKS_DIR])))} (`scse-lm-eval --help`), "
            "lm-eval's: `scse-lm-eval ls tasks`")


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's CLI with the model registered when the arguments name it (lm-eval 0.4 has no
    plugin entry point). `batch_size=` and `device=` in --model_args become --batch_size and
    --device: lm-eval's CLI passes those two to every model itself."""
    if importlib.util.find_spec("lm_eval") is None:
        print("scse-lm-eval: lm_eval is not installed; pip install 'scse-dist[lm-eval]'",
              file=sys.stderr)
        return 1
    args = hoist_model_args(list(sys.argv[1:] if argv is None else argv))
    command = args[0] if args else ""
    if not args or (command not in ("ls", "validate") and {"-h", "--help"} & set(args)):
        print(__doc__)  # then lm-eval's own help
    elif command != "ls" and (refused := refused_tasks(args)):
        print(refused, file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    model = model_named(args)
    if model == MODEL_NAME:
        import scse_dist.lmeval.model  # noqa: F401  (registers --model scse)
    # run, ls and validate all take --include_path; without arguments lm-eval prints its help
    if args and not option_values(args, ("--include_path",)):
        args += ["--include_path", TASKS_DIR]
    sys.argv = ["scse-lm-eval", *args]  # lm-eval's CLI parses sys.argv itself
    if model is not None:  # a model runs (imports torch; --help and `ls` need neither)
        from scse_dist.threads import configure_threads

        configure_threads()  # as scse-eval: no busy-waiting threads beyond the free cores
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
