"""kvfleet's Kubernetes operator: InferenceService resources in, autoscaled fleets of runtime pods out.

Imported as `kvfleet.operator`. It must never import torch or `kvfleet.runtime`.
"""
