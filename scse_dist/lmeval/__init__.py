"""lm-evaluation-harness integration: the `scse` model (scse_dist.lmeval.model), the offline tasks
scse_lambada and scse_wikitext (TASKS_DIR), and the `scse-lm-eval` command (scse_dist.lmeval.cli).

Importing this package does not import lm_eval (an optional extra: `pip install '.[lm-eval]'`).
"""

from pathlib import Path

TASKS_DIR = str(Path(__file__).resolve().parent / "tasks")
MODEL_NAME = "scse"  # lm-eval's --model name of scse_dist.lmeval.model
