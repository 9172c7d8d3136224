from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from webhook.config import Settings, build_settings, dump_settings, load_settings
from webhook.errors import ConfigError


def test_defaults_follow_the_spec() -> None:
    settings = load_settings(environ={})
    assert settings.mode == "enforce"
    assert settings.failure_policy == "Ignore"
    assert (settings.ptrace.mode, settings.ptrace.target, settings.ptrace.allow_pod_override) == (
        "add",
        "primary",
        False,
    )
    assert settings.copilot.name_prefix == "flyte-copilot-"
    assert settings.copilot.commands == ("/bin/flyte-copilot",)
    assert settings.server.port == 8443
    assert settings.server.max_body_bytes == 7 * 1024 * 1024
    assert settings.server.deadline_seconds == 2
    assert settings.preview.enabled is True


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("ptrace:\n  mode: keep\n  target: all\nserver:\n  port: 9000\n  tlsMinVersion: 1.3\n")
    env = {"COPILOT_WEBHOOK_PTRACE__MODE": "drop", "COPILOT_WEBHOOK_FAILUREPOLICY": "Fail"}
    settings = load_settings(config, environ=env, overrides={"server": {"port": 9443}})
    assert settings.ptrace.mode == "drop"  # the environment wins over the file
    assert settings.ptrace.target == "all"  # the file wins over the defaults
    assert settings.failure_policy == "Fail"
    assert settings.server.port == 9443  # command-line flags win over everything
    assert settings.server.tls_min_version == "1.3"  # YAML's float 1.3 is read as the version "1.3"


def test_config_file_from_environment(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("mode: shadow\n")
    assert load_settings(environ={"COPILOT_WEBHOOK_CONFIG": str(config)}).mode == "shadow"


def test_environment_accepts_snake_and_camel_spellings() -> None:
    settings = load_settings(
        environ={"COPILOT_WEBHOOK_PTRACE__ALLOW_POD_OVERRIDE": "true", "COPILOT_WEBHOOK_COPILOT__NAMEPREFIX": "x-"}
    )
    assert settings.ptrace.allow_pod_override is True
    assert settings.copilot.name_prefix == "x-"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ptrace": {"mode": "maybe"}}, "ptrace.mode: 'maybe' is not allowed; expected 'add', 'drop' or 'keep'"),
        ({"ptrace": {"target": "everyone"}}, "ptrace.target: 'everyone' is not allowed"),
        ({"ptrace": {"mood": "add"}}, "ptrace.mood: unknown key"),
        ({"failurePolicy": "ignore"}, "failurePolicy: 'ignore' is not allowed; expected 'Ignore' or 'Fail'"),
        ({"server": {"port": 70000}}, "server.port: 70000 is invalid"),
        ({"server": {"tlsMinVersion": "1.1"}}, "server.tlsMinVersion: '1.1' is not allowed"),
        ({"bogus": 1}, "bogus: unknown key"),
    ],
)
def test_invalid_values_are_refused_naming_key_value_and_choices(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        build_settings(data)


def test_unknown_environment_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"COPILOT_WEBHOOK_PTRACE__MOOD: unknown key 'MOOD' under ptrace; known: "):
        load_settings(environ={"COPILOT_WEBHOOK_PTRACE__MOOD": "drop"})


@pytest.mark.parametrize(
    ("text", "message"),
    [("ptrace: [", "is not valid YAML"), ("- a\n- b\n", "must hold a mapping of keys, not a list")],
)
def test_bad_config_files(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml' cannot be read"):
        load_settings(tmp_path / "nope.yaml", environ={})


def test_dump_uses_helm_value_keys() -> None:
    dumped = dump_settings(build_settings({}))
    assert dumped["ptrace"] == {"mode": "add", "target": "primary", "allowPodOverride": False}
    assert "failurePolicy" in dumped
    assert dumped["server"]["maxBodyBytes"] == 7340032
    assert build_settings(dumped) == build_settings({}), "the dump must read back as the same settings"


def test_values_derived_from_settings_are_computed_once_and_not_pickled() -> None:
    """Matchers and the puller template are cached on the (immutable) settings object; a preview worker
    receives the settings pickled without them and derives its own."""
    import pickle

    from webhook.mutation.puller import container_template

    settings = build_settings({"imagePuller": {"exclude": []}})
    puller = settings.image_puller
    assert puller.memo(container_template) is puller.memo(container_template)
    assert puller.unwanted("anything") is False
    assert settings.copilot.image_matcher("cr.flyte.org/flyteorg/flytecopilot:v1.15.0")
    copy = pickle.loads(pickle.dumps(settings))
    assert copy == settings
    assert "_memo" in puller.__dict__
    assert "_memo" not in copy.image_puller.__dict__
    assert copy.image_puller.memo(container_template) == puller.memo(container_template)


def _undescribed(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of the model's fields without a description, sections (nested models, and the models a
    mapping holds) walked into rather than described themselves."""
    missing = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        annotation = field.annotation
        if typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
            if not field.description:
                missing.append(key)
            key += ".<key>"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            missing += _undescribed(annotation, key + ".")
        elif not field.description:
            missing.append(key)
    return missing


def test_every_settings_field_has_its_description() -> None:
    """docs/configuration.md is generated from these descriptions (the field docstrings): a row without one
    tells the reader nothing."""
    assert _undescribed(Settings) == []
