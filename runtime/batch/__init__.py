"""Batch inference: OpenAI batch files run offline (`kvfleet run-batch`) or through the Batch API."""
