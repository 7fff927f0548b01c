"""Structured outputs: output constrained to a JSON schema, a regex, a choice or a grammar, with xgrammar."""
