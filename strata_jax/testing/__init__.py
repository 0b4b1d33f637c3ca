"""Test helpers: vocabulary files, Hugging Face references, GGUF edits, chat templates. The model
makers are strata_jax/makers/ (user commands too), the default model's fetch strata_jax/fetch.py and
fault injection engine/faults.py: the layers that use them."""
