"""Run real vLLM prefill / decode API servers side by side and compare with a single server."""
