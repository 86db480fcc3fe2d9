"""Helpers of the study tests (tests/experiments, the study notebooks)."""

import contextlib


@contextlib.contextmanager
def persistent_compile_cache(path: str):
    """JAX's persistent compilation cache in `path` while the block runs; the previous settings afterwards."""
    import jax

    def reset():
        try:
            from jax._src import compilation_cache

            compilation_cache.reset_cache()  # the cache is otherwise set up once per process
        except (ImportError, AttributeError):
            pass

    previous = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    reset()
    try:
        yield path
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
        reset()
