"""The model runner and the sampler: one scheduled step in, sampled tokens out."""
