"""`scse-lm-eval`: lm-eval's own CLI with the `scse` model registered and the offline tasks found.

    scse-lm-eval --model scse --model_args pretrained=EXPORT,depth=8 \\
                 --tasks scse_lambada --metadata lambada=lambada_test.jsonl

lm-eval 0.4 has no plugin entry point, so its `lm_eval` command cannot find a third-party model:
this one imports the model (registering it) when the arguments name it (`--model scse`; the import
loads torch, which `--help` or `ls tasks` need not wait for) and runs lm-eval's CLI with the
arguments as given.
Without --include_path it adds the package's task dir (scse_dist.lmeval.TASKS_DIR).
`batch_size=` and `device=` given in --model_args become --batch_size and --device: lm-eval's
CLI passes those two to every model itself, and a model arg of the same name would collide.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from scse_dist.lmeval import MODEL_NAME, TASKS_DIR

HOISTED = ("batch_size", "device")  # model args that lm-eval's CLI passes itself


def model_named(args: Sequence[str]) -> Optional[str]:
    """The model the arguments select (`--model NAME`, `--model=NAME`, `-m NAME`); None when they
    run none (`--help`, `ls tasks`)."""
    for flag, value in zip(args, [*args[1:], None]):
        if flag.startswith("--model="):
            return flag.split("=", 1)[1]
        if flag in ("--model", "-m") and value is not None:
            return value
    return None


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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("scse-lm-eval: lm_eval is not installed; pip install 'scse-dist[lm-eval]'",
              file=sys.stderr)
        return 1
    args = hoist_model_args(list(sys.argv[1:] if argv is None else argv))
    model = model_named(args)
    if model == MODEL_NAME:
        import scse_dist.lmeval.model  # noqa: F401  (registers --model scse)
    # run, ls and validate all take --include_path; without arguments lm-eval prints its help
    if args and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", TASKS_DIR]
    sys.argv = ["scse-lm-eval", *args]  # lm-eval's CLI parses sys.argv itself
    if model is not None:  # a model runs (imports torch; --help and `ls` need neither)
        from scse_dist.threads import configure_threads

        configure_threads()  # as scse-eval: no busy-waiting threads beyond the free cores
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
