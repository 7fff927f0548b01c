"""`spec.safety`: the platform's default policy (chart values) under a service's own, checked so that a
service loosens the platform's policy only where the platform allows it, and rendered into the runtime's
`--safety-config`.

The policy's shape is the runtime's (`kvfleet serve --safety-config`, docs/safety.md); the CRD's schema and
the runtime validate it. Here: the merge, what counts as loosening, and `guard.service`, another
InferenceService of the namespace serving the guard model, resolved to its in-cluster URL.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.contract.safety import (
    ACTIONS,
    DEFAULT_ACTION,
    DEFAULT_LEVEL,
    LEVELS,
    STRICTNESS_FIELDS,
    loosened,
    tier_policy,
)
from kvfleet.contract.tiers import TIER_NAMES
from kvfleet.operator.schema import Rule, array, boolean, integer, number, obj, string
from kvfleet.operator.spec import UNSUPPORTED_BY_RUNTIME_REASON, InferenceServiceSpec, SpecError

# What the platform may let services loosen (chart value safety.allowLoosen).
LOOSENABLE = ("level", "action", "checkers", "failOpen", "logContent")
LOOSENED_REASON = "SafetyLoosened"
GUARD_UNAVAILABLE_REASON = "GuardUnavailable"
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


_CHECKERS = ["rules", "guard", "hook"]
_PII_DETECTORS = ["email", "phone", "card", "iban", "api_key"]
_FAIL_OPEN = (
    "Let the text through while the {checker} is unavailable (down, slower than timeout, or no verdict); "
    "otherwise it is a finding of category checker_unavailable."
)
_TIMEOUT = number(
    "Seconds the whole call may take, from connecting to the answer's last byte.",
    minimum=0,
    exclusiveMinimum=True,
)
# What a policy sets, for every request or (under tiers) for one tier's.
_POLICY_PROPERTIES = {
    "level": string(
        "Which findings count: low counts the surest (score 0.9 and up: card numbers, IBANs, secrets, "
        "blocklisted words, guard verdicts), medium from 0.5 (adds e-mail addresses and phone numbers), high "
        "from 0.2; off checks nothing.",
        enum=list(LEVELS),
    ),
    "action": string(
        "What a finding does: block (a 400 content_filter for input, the refusal and finish_reason "
        "content_filter for output), redact (replace what rules found; a verdict on the whole text blocks), "
        "or flag (count it in the metrics and let the text through).",
        enum=list(ACTIONS),
    ),
    "input": array("The checkers run on each request's input.", string("", enum=_CHECKERS)),
    "output": array(
        "The checkers run on each answer, in windows of windowTokens while streaming.",
        string("", enum=_CHECKERS),
    ),
    "refusal": string("What a blocked request or answer is told.", minLength=1),
    "windowTokens": integer(
        "Tokens of a streamed answer checked (and held back) at a time.", minimum=1, maximum=4096
    ),
}
_RULES = obj(
    "Blocklisted words, the platform's own patterns, and PII detectors.",
    {
        "blocklist": array("Words and phrases found wherever they occur.", string("", minLength=1)),
        "patterns": array(
            "Regular expressions, each finding text of its category.",
            obj(
                "",
                {
                    "category": string(
                        "The category findings of the pattern are reported under.", minLength=1
                    ),
                    "regex": string("A regular expression (Python's syntax) searched for in the text."),
                    "score": number("How sure a match is, from 0 to 1 (1 when unset).", minimum=0, maximum=1),
                },
                required=["category", "regex"],
            ),
        ),
        "pii": array(
            "The built-in detectors of personal data that run (all of them when unset).",
            string("", enum=_PII_DETECTORS),
        ),
    },
)
_GUARD = obj(
    "A guard model (a classifier prompt in the manner of Llama Guard): another InferenceService of this "
    'namespace (service), or an OpenAI-compatible URL or "self" (endpoint).',
    {
        "service": string("An InferenceService of this namespace serving the guard model."),
        "endpoint": string(
            'An OpenAI-compatible base URL (".../v1") of the guard model, or "self": this model.'
        ),
        "model": string("The model name sent to the guard; the endpoint's only model when unset."),
        "timeout": _TIMEOUT,
        "failOpen": boolean(_FAIL_OPEN.format(checker="guard")),
        "apiKeyEnv": string("The environment variable of the runtime holding the endpoint's API key."),
        "categories": obj(
            "The guard's category codes (S1, ...) mapped to the names findings are reported under.",
            additionalProperties=string(""),
        ),
        "extraBody": obj(
            "Fields merged into the body of every guard request (sampling options, a priority).",
            **{"x-kubernetes-preserve-unknown-fields": True},
        ),
    },
    rules=[Rule("has(self.service) != has(self.endpoint)", "give one of service and endpoint")],
)
_HOOK = obj(
    "The platform's own HTTP checker.",
    {
        "url": string("Where each text is posted for a verdict."),
        "timeout": _TIMEOUT,
        "failOpen": boolean(_FAIL_OPEN.format(checker="hook")),
    },
    required=["url"],
)
# The CRD's schema of spec.safety.
POLICY_SCHEMA = obj(
    "",
    {
        **_POLICY_PROPERTIES,
        "tiers": obj(
            "Per SLA tier of the request, the fields above that differ.",
            maxProperties=len(TIER_NAMES),
            additionalProperties=obj("", _POLICY_PROPERTIES),
            **{
                "x-kubernetes-validations": [
                    Rule(
                        f"self.all(t, t in [{', '.join(repr(tier) for tier in TIER_NAMES)}])",
                        f"tiers are {', '.join(TIER_NAMES[:-1])} and {TIER_NAMES[-1]}",
                    ).render()
                ]
            },
        ),
        "rules": _RULES,
        "guard": _GUARD,
        "hook": _HOOK,
        "audit": obj(
            "What the logs may hold.",
            {"logContent": boolean("Let logs quote the text that was flagged.")},
        ),
    },
)


class GuardState(enum.Enum):
    READY = "Ready"
    # The InferenceService exists but none of its replicas is ready.
    UNAVAILABLE = "Unavailable"
    NOT_FOUND = "NotFound"


@dataclass(frozen=True)
class SafetyPlatform:
    """The platform's defaults, as canonical JSON (so that render options stay hashable), and what a
    service may loosen."""

    defaults_json: str = "{}"
    allow_loosen: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, defaults: str, allow_loosen: str) -> SafetyPlatform:
        """From the operator's flags: a JSON policy and a comma-separated list. ValueError says why not."""
        try:
            value = json.loads(defaults or "{}")
        except json.JSONDecodeError as error:
            raise ValueError(f"the safety defaults are not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("the safety defaults must be a JSON object")
        allowed = frozenset(item.strip() for item in allow_loosen.split(",") if item.strip())
        unknown = sorted(allowed - set(LOOSENABLE))
        if unknown:
            raise ValueError(
                f"cannot allow loosening {unknown[0]!r}; the choices are {', '.join(LOOSENABLE)}"
            )
        return cls(json.dumps(value, sort_keys=True, separators=(",", ":")), allowed)

    @property
    def defaults(self) -> dict[str, Any]:
        return json.loads(self.defaults_json)


def parse_safety(raw: Any, *, name: str) -> Mapping[str, Any] | None:
    """spec.safety as given, after the checks rendering relies on."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError("InvalidSpec", "spec.safety must be an object")
    guard = raw.get("guard")
    if guard is not None:
        if not isinstance(guard, Mapping):
            raise SpecError("InvalidSpec", "spec.safety.guard must be an object")
        service, endpoint = guard.get("service"), guard.get("endpoint")
        if (service is None) == (endpoint is None):
            raise SpecError("InvalidSpec", "spec.safety.guard needs one of service and endpoint")
        if service is not None and (not isinstance(service, str) or not _DNS_1035_LABEL.fullmatch(service)):
            raise SpecError("InvalidSpec", "spec.safety.guard.service must name an InferenceService")
        if service == name:
            raise SpecError(
                "InvalidSpec",
                'spec.safety.guard.service names this service itself; use endpoint: "self" to judge with '
                "its own model",
            )
    return raw


def merged(platform: SafetyPlatform, service: Mapping[str, Any] | None) -> dict[str, Any]:
    """The service's policy over the platform's: objects merge field by field, anything else replaces; a
    guard the service names (service or endpoint) replaces the platform's."""
    base = platform.defaults
    guard = (service or {}).get("guard")
    if guard is not None and "guard" in base:
        base["guard"] = {k: v for k, v in base["guard"].items() if k not in ("service", "endpoint")}
    return _merge(base, service or {})


def check_loosening(platform: SafetyPlatform, service: Mapping[str, Any] | None) -> None:
    """Raises SpecError(SafetyLoosened) when the service's policy is more lenient than the platform's in a
    way the platform does not allow; the message names each field."""
    base, effective = platform.defaults, merged(platform, service)
    problems = []
    allowed = platform.allow_loosen
    tiers = {None, *(base.get("tiers") or {}), *(effective.get("tiers") or {})}
    for tier in sorted(tiers, key=lambda t: t or ""):
        was, now = _policy(base, tier), _policy(effective, tier)
        where = "spec.safety" if tier is None else f"spec.safety.tiers.{tier}"
        problems += [
            _loosening(where, key, was, now)
            for key in loosened(now, was)
            if (key if key in ("level", "action") else "checkers") not in allowed
        ]
    for checker in ("guard", "hook"):
        opened = _flag(effective, checker, "failOpen") and not _flag(base, checker, "failOpen")
        if opened and checker in base and "failOpen" not in allowed:
            problems.append(
                f"spec.safety.{checker}.failOpen lets text through where the platform fails closed"
            )
    if effective.get("allowLooserTiers") and not base.get("allowLooserTiers"):
        # Only the platform lets clients pick a looser tier's policy.
        problems.append(
            "spec.safety.allowLooserTiers lets clients pick a looser policy than the platform does"
        )
    logs = _flag(effective, "audit", "logContent") and not _flag(base, "audit", "logContent")
    if logs and "logContent" not in allowed:
        problems.append("spec.safety.audit.logContent would log text the platform keeps out of logs")
    if problems:
        raise SpecError(
            LOOSENED_REASON,
            f"the safety policy loosens the platform's where it does not allow: {'; '.join(problems)}",
        )


def check_guardrails_served(platform: SafetyPlatform, spec: InferenceServiceSpec) -> None:
    """Raises SpecError for a vLLM service under a platform safety policy: vLLM's server has no guardrails,
    and running it would serve the service without the policy every service is meant to have."""
    if spec.engine.runtime == "vllm" and platform.defaults:
        raise SpecError(
            UNSUPPORTED_BY_RUNTIME_REASON,
            "spec.engine.runtime vllm is refused under the platform's safety policy (chart values "
            "safety.defaults): its guardrails run in kvfleet's runtime, and vLLM's server has none",
        )


def guard_service(platform: SafetyPlatform, service: Mapping[str, Any] | None) -> str | None:
    """The InferenceService the guard model runs as, if the effective policy names one."""
    guard = merged(platform, service).get("guard") or {}
    return guard.get("service")


def safety_config(
    platform: SafetyPlatform, service: Mapping[str, Any] | None, namespace: str, cluster_domain: str
) -> str | None:
    """The runtime's --safety-config (compact JSON), or None when neither the platform nor the service has
    a policy. A guard service becomes the URL of its Service (port 80)."""
    policy = merged(platform, service)
    if not policy:
        return None
    guard = policy.get("guard")
    if guard is not None and guard.get("service") is not None:
        guard = dict(guard)
        guard["endpoint"] = f"http://{guard.pop('service')}.{namespace}.svc.{cluster_domain}/v1"
        policy["guard"] = guard
    return json.dumps(policy, sort_keys=True, separators=(",", ":"))


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _merge(result[key], value)
        else:
            result[key] = value
    return result


def _loosening(where: str, key: str, was: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    if key == "level":
        return f"{where}.level {now['level']!r} is below the platform's {was['level']!r}"
    if key == "action":
        return f"{where}.action {now['action']!r} is weaker than the platform's {was['action']!r}"
    dropped = sorted(set(was[key]) - set(now[key]))
    return f"{where}.{key} drops the platform's {', '.join(dropped)}"


def _policy(config: Mapping[str, Any], tier: str | None) -> dict[str, Any]:
    """The strictness of a tier's policy, from the policy as written (camelCase JSON)."""
    policy = {
        "level": config.get("level", DEFAULT_LEVEL),
        "action": config.get("action", DEFAULT_ACTION),
        "input": list(config.get("input") or []),
        "output": list(config.get("output") or []),
    }
    override = (config.get("tiers") or {}).get(tier) if tier is not None else None
    merged_policy = tier_policy(policy, override)
    return {key: merged_policy[key] for key in STRICTNESS_FIELDS}


def _flag(config: Mapping[str, Any], section: str, key: str) -> bool:
    return bool((config.get(section) or {}).get(key, False))
