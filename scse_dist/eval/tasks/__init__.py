"""The evaluation tasks, one module each with its reader, its scorer and its `Task` record, which
it registers (scse_dist.task_registry) when imported here:
    heldout          perplexity on held-out shards (a dir with index.json), or any JSONL/text corpus
    wikitext         WikiText raw: document-wise sliding window; ppl, word_ppl, bits_per_byte
    lambada          last-word prediction: lm-eval's LAMBADA acc and perplexity
    diagnose         per depth ||b|| (forcing bias at the anchor), ||D_t||, ||h_t - h_{t-1}||
    multiple_choice  hellaswag, piqa, arc_easy, arc_challenge, multiple_choice: lm-eval's acc and
                     acc_norm
A task module imports torch only inside its scorer: the registry is read by config validation and
`scse-eval --help`, before any model loads. What they share (run_task, TaskRun, document and
context/target scoring): scse_dist.eval.task_run.
"""

# The import order is the registry's order (eval.tasks' "must be one of heldout, wikitext, ...").
# isort: off
from scse_dist.eval.tasks import heldout  # noqa: F401
from scse_dist.eval.tasks import wikitext  # noqa: F401
from scse_dist.eval.tasks import lambada  # noqa: F401
from scse_dist.eval.tasks import diagnose  # noqa: F401
from scse_dist.eval.tasks import multiple_choice  # noqa: F401
# isort: on
