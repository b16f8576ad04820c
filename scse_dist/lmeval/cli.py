"""`scse-lm-eval`: lm-eval's own CLI with the `scse` model registered and the offline tasks found.

    scse-lm-eval --model scse --model_args pretrained=EXPORT,depth=8 \\
                 --tasks scse_lambada --metadata lambada=lambada_test.jsonl

lm-eval 0.4 has no plugin entry point, so its `lm_eval` command cannot find a third-party model:
this one imports the model (registering it) and runs lm-eval's CLI with the arguments as given.
Without --include_path it adds the package's task dir (scse_dist.lmeval.TASKS_DIR).
"""

from __future__ import annotations

import sys
from typing import Sequence

from scse_dist.lmeval import TASKS_DIR


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("scse-lm-eval: lm_eval is not installed; pip install 'scse-dist[lm-eval]'",
              file=sys.stderr)
        return 1
    import scse_dist.lmeval.model  # noqa: F401  (registers --model scse)

    args = list(sys.argv[1:] if argv is None else argv)
    subcommand = bool(args) and args[0] in ("run", "ls", "validate")
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in args) and \
            (not subcommand or args[0] in ("run", "ls")):
        args += ["--include_path", TASKS_DIR]
    sys.argv = ["scse-lm-eval", *args]  # lm-eval's CLI parses sys.argv itself
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
