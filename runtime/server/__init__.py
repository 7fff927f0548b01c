"""OpenAI-compatible HTTP serving of the engine: `kvfleet serve`."""
