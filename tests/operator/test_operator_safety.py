"""spec.safety: merged over the platform's defaults, loosening refused unless allowed, the guard service
resolved to its URL, rendered into an argument the runtime itself accepts, and the guard's state in the
status and events."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from kvfleet.contract.safety import ACTIONS, DEFAULT_ACTION, DEFAULT_LEVEL, LEVEL_THRESHOLDS, LEVELS, Action
from kvfleet.contract.safety import ACTIONS as RUNTIME_ACTIONS
from kvfleet.contract.safety import LEVELS as RUNTIME_LEVELS
from kvfleet.operator.render import Owner, RenderOptions, render_deployment
from kvfleet.operator.safety import LOOSENABLE, SafetyPlatform, check_loosening
from kvfleet.operator.spec import SpecError, parse_spec
from kvfleet.runtime.safety.config import Policy, parse_safety_config

PLATFORM = SafetyPlatform.parse(
    json.dumps(
        {
            "level": "medium",
            "input": ["rules"],
            "output": ["rules"],
            "rules": {"blocklist": ["forbidden"]},
            "guard": {"endpoint": "self", "failOpen": False},
            "tiers": {"batch": {"action": "flag"}},
        }
    ),
    "",
)


def _safety_arg(spec: dict[str, Any], platform: SafetyPlatform = PLATFORM) -> dict[str, Any] | None:
    parsed = parse_spec({"model": {"uri": "file:///m"}, **spec}, name="svc")
    options = RenderOptions(safety=platform)
    deployment = render_deployment(Owner("svc", "team-a", "uid"), parsed, 1, options)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    if "--safety-config" not in args:
        return None
    text = args[args.index("--safety-config") + 1]
    parse_safety_config(text)  # the runtime accepts what the operator renders
    return json.loads(text)


def test_no_policy_anywhere_renders_no_flag() -> None:
    assert _safety_arg({}, SafetyPlatform()) is None


def test_the_platforms_defaults_apply_to_a_service_without_safety() -> None:
    assert _safety_arg({}) == PLATFORM.defaults


def test_a_service_tightens_and_names_another_service_as_its_guard() -> None:
    config = _safety_arg(
        {
            "safety": {
                "level": "high",
                "output": ["rules", "guard"],
                "rules": {"pii": ["email"]},
                "guard": {"service": "llama-guard", "timeout": 3},
            }
        }
    )
    assert config is not None
    assert config["level"] == "high"
    assert config["output"] == ["rules", "guard"]
    # Objects merge field by field: the platform's blocklist stays beside the service's detectors.
    assert config["rules"] == {"blocklist": ["forbidden"], "pii": ["email"]}
    assert config["guard"] == {
        "endpoint": "http://llama-guard.team-a.svc.cluster.local/v1",
        "failOpen": False,
        "timeout": 3,
    }


@pytest.mark.parametrize(
    ("safety", "complaint"),
    [
        ({"level": "low"}, "spec.safety.level 'low' is below the platform's 'medium'"),
        ({"action": "flag"}, "spec.safety.action 'flag' is weaker than the platform's 'block'"),
        ({"input": []}, "spec.safety.input drops the platform's rules"),
        ({"tiers": {"standard": {"level": "off"}}}, "spec.safety.tiers.standard.level 'off'"),
        (
            {"tiers": {"batch": {"output": ["guard"]}}},
            "spec.safety.tiers.batch.output drops the platform's rules",
        ),
        ({"guard": {"failOpen": True}}, "spec.safety.guard.failOpen lets text through"),
        ({"audit": {"logContent": True}}, "spec.safety.audit.logContent would log text"),
    ],
)
def test_loosening_is_refused_unless_the_platform_allows_it(safety: dict[str, Any], complaint: str) -> None:
    with pytest.raises(SpecError) as raised:
        check_loosening(PLATFORM, safety)
    assert raised.value.reason == "SafetyLoosened"
    assert complaint in raised.value.message
    allow_all = SafetyPlatform.parse(PLATFORM.defaults_json, "level,action,checkers,failOpen,logContent")
    check_loosening(allow_all, safety)


def test_only_the_platform_lets_clients_pick_looser_tiers() -> None:
    allow_all = SafetyPlatform.parse(PLATFORM.defaults_json, ",".join(LOOSENABLE))
    with pytest.raises(SpecError, match="allowLooserTiers lets clients pick a looser policy"):
        check_loosening(allow_all, {"allowLooserTiers": True})
    platform = SafetyPlatform.parse(json.dumps({**PLATFORM.defaults, "allowLooserTiers": True}), "")
    check_loosening(platform, {"allowLooserTiers": True})


def test_tightening_needs_no_permission() -> None:
    check_loosening(
        PLATFORM,
        {
            "level": "high",
            "action": "block",
            "input": ["rules", "hook"],
            "hook": {"url": "http://moderation.platform/check"},
            "tiers": {"batch": {"action": "redact"}},
        },
    )


@pytest.mark.parametrize(
    ("safety", "message"),
    [
        ("strict", "spec.safety must be an object"),
        ({"guard": {}}, "spec.safety.guard needs one of service and endpoint"),
        ({"guard": {"service": "g", "endpoint": "self"}}, "needs one of service and endpoint"),
        ({"guard": {"service": "Guard_1"}}, "spec.safety.guard.service must name an InferenceService"),
        ({"guard": {"service": "svc"}}, "names this service itself"),
    ],
)
def test_bad_safety_specs(safety: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec({"model": {"uri": "file:///m"}, "safety": safety}, name="svc")


@pytest.mark.parametrize(
    ("defaults", "allow", "message"),
    [("[1]", "", "must be a JSON object"), ("{", "", "not valid JSON"), ("{}", "level,volume", "'volume'")],
)
def test_bad_platform_settings(defaults: str, allow: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SafetyPlatform.parse(defaults, allow)


def test_the_operator_ranks_the_runtimes_levels_and_actions() -> None:
    # Strictest last: a level counts ever lower scores, an action lets ever less through.
    thresholds = [LEVEL_THRESHOLDS[level] for level in LEVELS]
    assert thresholds[0] is None and thresholds[1:] == sorted(thresholds[1:], reverse=True)
    assert set(LEVELS) == set(LEVEL_THRESHOLDS)
    assert set(ACTIONS) == set(get_args(Action))
    assert (LEVELS, ACTIONS) == (RUNTIME_LEVELS, RUNTIME_ACTIONS)
    assert (Policy().level, Policy().action) == (DEFAULT_LEVEL, DEFAULT_ACTION)
