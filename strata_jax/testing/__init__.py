"""Test helpers: tiny-model makers, vocabulary files, Hugging Face references. The default model's fetch
is strata_jax/fetch.py and fault injection engine/faults.py: the layers that use them."""
