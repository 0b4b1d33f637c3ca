"""Running windows on the device: the compiled programs and their cache, the KV cache and its host
tier, the expert placement, the sampler and its controls, the layer-stepped path and the embeddings
programs."""
