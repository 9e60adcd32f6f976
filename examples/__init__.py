"""Scripts launched with torchrun (see each one's docstring); a package so that
tests/test_examples.py can run their training loops on its ranks."""
