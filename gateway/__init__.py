"""kvfleet's fleet gateway: one OpenAI-compatible endpoint in front of every InferenceService.

Imported as `kvfleet.gateway`. It routes each request by its `model` to a ready replica, holds requests in
one tier-ordered queue per model while every replica is saturated (or the model is scaled to zero), and
never imports torch.
"""
