"""Multimodal input: images and audio clips decoded and preprocessed in the front end, encoded and cached in
the engine."""
