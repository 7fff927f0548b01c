"""Multimodal input: images decoded and preprocessed in the front end, encoded and cached in the engine."""
