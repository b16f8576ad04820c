"""Evaluation: held-out, WikiText, LAMBADA and diagnostic tasks at several loop depths (one forward
per batch), results JSON and tables, reports, `scse-eval`, `scse-report`.

Nothing is imported here, so `scse-report` starts without torch: import from the modules
(`scse_dist.eval.perplexity`, `.results`, `.tasks`, `.cli`, `.report`)."""
