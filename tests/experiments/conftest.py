"""The studies' tests run on the session's tiny trained pair (tests/conftest.py: tiny_pair_dir).

No persistent compilation cache here: writing it (jax's put_executable_and_time) aborted the pytest
worker twice on this CPU jaxlib, so every test compiles what it runs."""
