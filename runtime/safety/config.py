"""The safety policy of one server, as `kvfleet serve --safety-config` and the InferenceService's
`spec.safety` give it (camelCase JSON, unknown fields refused)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from kvfleet.contract.safety import (
    DEFAULT_ACTION,
    DEFAULT_LEVEL,
    LEVEL_THRESHOLDS,
    Action,
    Level,
    loosened,
    tier_policy,
)
from kvfleet.contract.tiers import TIER_NAMES
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

CheckerName = Literal["rules", "guard", "hook"]
PiiDetector = Literal["email", "phone", "card", "iban", "api_key"]

GUARD_SELF = "self"
DEFAULT_REFUSAL = (
    "I can't help with that: the request or its answer goes against this service's safety policy."
)
DEFAULT_WINDOW_TOKENS = 16

Score = Annotated[float, Field(ge=0.0, le=1.0)]
Seconds = Annotated[float, Field(gt=0.0)]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class PatternRule(_Config):
    category: Annotated[str, Field(min_length=1)]
    regex: str
    score: Score = 1.0

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class RulesConfig(_Config):
    blocklist: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    patterns: tuple[PatternRule, ...] = ()
    pii: tuple[PiiDetector, ...] = ("email", "phone", "card", "iban", "api_key")


class GuardConfig(_Config):
    # An OpenAI-compatible base URL (".../v1") serving the guard model, or "self": this server's own model.
    endpoint: str
    # The model name sent to the endpoint; defaults to the endpoint's only model.
    model: str | None = None
    timeout: Seconds = 5.0
    fail_open: bool = False
    # The environment variable holding the endpoint's API key.
    api_key_env: str | None = None
    # Guard category codes (S1...) -> the names findings are reported under, over the built-in mapping.
    categories: dict[str, str] = {}
    # Fields merged into every guard request's body (sampling options, a priority).
    extra_body: dict[str, Any] = {}

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value != GUARD_SELF and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"must be {GUARD_SELF!r} or an http(s) URL, got {value!r}")
        return value.rstrip("/")


class HookConfig(_Config):
    url: Annotated[str, Field(pattern=r"^https?://[^/\s]+")]
    timeout: Seconds = 2.0
    fail_open: bool = False


class AuditConfig(_Config):
    # Whether logs may quote the text that was flagged; otherwise they name categories only.
    log_content: bool = False


class Policy(_Config):
    """What runs on a request of one tier and what its findings do."""

    level: Level = DEFAULT_LEVEL
    action: Action = DEFAULT_ACTION
    input: tuple[CheckerName, ...] = ()
    output: tuple[CheckerName, ...] = ()
    refusal: Annotated[str, Field(min_length=1)] = DEFAULT_REFUSAL
    # Output is checked (and held back) this many tokens at a time while streaming.
    window_tokens: Annotated[int, Field(ge=1, le=4096)] = DEFAULT_WINDOW_TOKENS

    @property
    def threshold(self) -> float | None:
        return LEVEL_THRESHOLDS[self.level]

    def is_at_least_as_strict_as(self, other: Policy) -> bool:
        """Whether this policy lets through nothing `other` would stop: a level and an action no weaker,
        and every checker `other` runs on input and output."""
        return not loosened(self.model_dump(), other.model_dump())


class PolicyOverride(_Config):
    level: Level | None = None
    action: Action | None = None
    input: tuple[CheckerName, ...] | None = None
    output: tuple[CheckerName, ...] | None = None
    refusal: Annotated[str, Field(min_length=1)] | None = None
    window_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None


class SafetyConfig(Policy):
    tiers: dict[str, PolicyOverride] = {}
    rules: RulesConfig | None = None
    guard: GuardConfig | None = None
    hook: HookConfig | None = None
    audit: AuditConfig = AuditConfig()
    # Whether a request may claim a tier whose policy is looser than its default tier's.
    allow_looser_tiers: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> SafetyConfig:
        unknown = set(self.tiers) - set(TIER_NAMES)
        if unknown:
            raise ValueError(f"tiers: unknown tier {sorted(unknown)[0]!r}; tiers are {', '.join(TIER_NAMES)}")
        for tier in [None, *self.tiers]:
            policy = self.policy(tier)
            for name in {*policy.input, *policy.output}:
                if getattr(self, name) is None:
                    where = f"tier {tier!r}" if tier else "the policy"
                    raise ValueError(
                        f"{where} runs the {name!r} checker, which is not configured ({name}: ...)"
                    )
        return self

    def policy(self, tier: str | None) -> Policy:
        """The policy of requests of `tier`: the defaults with that tier's overrides."""
        override = self.tiers.get(tier) if tier is not None else None
        base = self.model_dump(include=set(Policy.model_fields))
        return Policy.model_validate(tier_policy(base, override.model_dump() if override else None))

    def claimed_policy(self, tier: str, default_tier: str) -> Policy:
        """The policy of a request that claims `tier` (its `priority` field, the priority header, a Batch API
        line) where requests that claim none get `default_tier`. A client picks its tier for scheduling, not
        a weaker policy: a tier whose policy is looser in any way than the default tier's gives the default
        tier's policy, unless the platform allows looser tiers."""
        claimed, default = self.policy(tier), self.policy(default_tier)
        if self.allow_looser_tiers or claimed.is_at_least_as_strict_as(default):
            return claimed
        return default


def parse_safety_config(value: str) -> SafetyConfig:
    """A policy from JSON text, or from the path of a JSON file. Raises ValueError with a readable reason."""
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the safety config file {value!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the safety config is not valid JSON: {exc}") from None
    try:
        return SafetyConfig.model_validate(data)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'safety'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ValueError(f"invalid safety config: {reasons}") from None
