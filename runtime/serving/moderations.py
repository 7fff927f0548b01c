"""POST /v1/moderations: OpenAI's moderation answer from the server's own input checkers."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import NotFoundError
from kvfleet.runtime.safety.checker import Direction
from kvfleet.runtime.safety.config import LEVEL_THRESHOLDS
from kvfleet.runtime.safety.guardrails import UNAVAILABLE_CATEGORY
from kvfleet.runtime.serving.protocol import ModerationRequest

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService

# The categories every OpenAI moderation result carries; kvfleet's own (pii/email, blocklist, ...) follow.
OPENAI_CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)


class OpenAIServingModeration:
    def __init__(self, service: OpenAIService) -> None:
        self.service = service

    async def create_moderation(self, body: ModerationRequest) -> dict[str, Any]:
        body.refuse_unsupported()
        guardrails = self.service.guardrails
        if guardrails is None:
            raise NotFoundError("moderation needs a safety policy on this server (--safety-config)")
        texts = body.texts()
        policy = guardrails.policy(None)
        # The checkers the policy runs on input, else every one configured.
        names = policy.input or tuple(
            name for name in ("rules", "guard", "hook") if getattr(guardrails.config, name) is not None
        )
        # A service whose level is off still answers what its checkers find, at the default level.
        threshold = policy.threshold if policy.threshold is not None else LEVEL_THRESHOLDS["medium"]
        findings = await asyncio.gather(
            *(guardrails.findings(names, text, Direction.INPUT) for text in texts)
        )
        results = []
        for per_text in findings:
            scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0)
            for finding in per_text:
                scores[finding.category] = max(scores.get(finding.category, 0.0), finding.score)
            flagged = {
                category: score >= threshold or (category == UNAVAILABLE_CATEGORY and score > 0)
                for category, score in scores.items()
            }
            results.append(
                {
                    "flagged": any(flagged.values()),
                    "categories": flagged,
                    "category_scores": scores,
                    "category_applied_input_types": {category: ["text"] for category in scores},
                }
            )
        return {
            "id": f"modr-{uuid.uuid4().hex}",
            "model": body.model or self.service.model_name,
            "results": results,
        }
