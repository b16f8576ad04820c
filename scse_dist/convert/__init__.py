"""Converting between this stack's exports and other formats: `scse-convert` (cli.py);
Hugging Face Llama / Qwen3 folders in (hf_import.py) and out (hf_export.py)."""
