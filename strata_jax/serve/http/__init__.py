"""The OpenAI-compatible HTTP routes and what they share: request parsing and fields, the chat and
completion jobs, streaming, reasoning, logprobs, embeddings, CORS, metrics and the web UI."""
