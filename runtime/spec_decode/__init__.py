"""Speculative decoding: proposers guess the next tokens, the target model verifies them in one pass."""
