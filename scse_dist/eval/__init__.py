"""Evaluation at several loop depths: tasks, results JSON and tables, reports, `scse-eval`,
`scse-report`. Nothing is imported here, so `scse-report` starts without torch."""
