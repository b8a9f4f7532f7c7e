"""Repository scripts. A package so that tests and tools import them as `scripts.vllm...`, no sys.path edits."""
