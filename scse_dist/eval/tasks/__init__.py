"""The evaluation tasks, one module each holding its reader, its scorer and its `Task` record,
which it registers (scse_dist.task_registry) when imported here; torch loads only inside a
scorer. What the tasks share: scse_dist.eval.task_run."""

# The import order is the registry's order (eval.tasks' "must be one of heldout, wikitext, ...").
# isort: off
from scse_dist.eval.tasks import heldout  # noqa: F401
from scse_dist.eval.tasks import wikitext  # noqa: F401
from scse_dist.eval.tasks import lambada  # noqa: F401
from scse_dist.eval.tasks import diagnose  # noqa: F401
from scse_dist.eval.tasks import multiple_choice  # noqa: F401
# isort: on
