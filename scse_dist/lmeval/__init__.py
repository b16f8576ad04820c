"""lm-evaluation-harness integration: the `scse` model (model.py), the offline tasks (TASKS_DIR)
and `scse-lm-eval` (cli.py). Importing this package does not import lm_eval (an optional extra).
"""

from pathlib import Path

TASKS_DIR = str(Path(__file__).resolve().parent / "tasks")
MODEL_NAME = "scse"  # lm-eval's --model name of scse_dist.lmeval.model
