"""Llama-family models: config reading, the registry of architectures, weights loading, test-model making."""
