"""GGUF model makers, the user tools behind `strata-jax make-model` (random weights, any family we
serve, with a built-in tokenizer) and `strata-jax upcycle` (a dense llama model as a MoE one that
computes the same)."""
