"""Quantized weights: what a checkpoint's quantization_config says (`config`, read without torch), and the
projections and the loading that keep its weights quantized in memory (`linear`)."""
