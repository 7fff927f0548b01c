"""kvfleet: an inference runtime for LLMs and the Kubernetes operator that runs fleets of it."""

__version__ = "0.1.0"
