"""Backend capabilities and option schemas: built-ins as docs/backends.md's table says, plugins through the hooks."""

from __future__ import annotations

import json

import pytest

from retrain.backend.base import CONSERVATIVE_CAPABILITIES, Capabilities
from retrain.backend.capabilities import (
    HOOK_NAMES,
    builtin_backends,
    capabilities_of,
    describe_backend,
)
from retrain.errors import ConfigError
from tests.conftest import REPO, CliHere

# reports_sync_loss, preserves_token_advantages, supports_checkpoint_resume, resume_runtime_dependent, as
# docs/backends.md's capability table says (PRIME-RL's loss takes advantages per token)
BUILTIN_TABLE = {
    "local": (True, True, True, False),
    "tinker": (True, True, True, True),
    "prime_rl": (False, True, True, False),
}
HOOKS = "tests.plugins.backend_hooks"


def flags(caps: Capabilities) -> tuple[bool, bool, bool, bool]:
    return (
        caps.reports_sync_loss,
        caps.preserves_token_advantages,
        caps.supports_checkpoint_resume,
        caps.resume_runtime_dependent,
    )


def test_every_builtin_declares_its_capabilities_and_its_options():
    infos = {info.name: info for info in builtin_backends()}
    assert {name: flags(info.capabilities) for name, info in infos.items()} == BUILTIN_TABLE
    assert all(info.source == "builtin" for info in infos.values())
    assert infos["local"].extra is None and infos["local"].extra_installed
    assert (infos["tinker"].extra, infos["prime_rl"].extra) == ("tinker", "prime_rl")
    devices = infos["local"].options["devices"]
    assert (devices.type, devices.default) == ("str", "gpu:0") and devices.help
    assert infos["prime_rl"].options["transport"].choices == ("filesystem", "zmq")
    assert infos["tinker"].capabilities.samples_itself and infos["prime_rl"].capabilities.samples_itself


def test_a_plugin_without_hooks_gets_conservative_defaults_reported_as_such():
    info = describe_backend("tests.plugins.bare_backend.BareBackend")
    assert info.source == "plugin/default"
    assert info.capabilities == CONSERVATIVE_CAPABILITIES and not info.capabilities.preserves_token_advantages
    assert info.options == {}
    info.check_options({"_target_": info.target, "anything": 1})  # no schema declared: nothing to refuse


def test_module_hooks_describe_a_class_that_declares_nothing():
    info = describe_backend(f"{HOOKS}.ModuleHookedBackend")
    assert info.source == "plugin/hook"
    assert info.capabilities.preserves_token_advantages and info.capabilities.reports_sync_loss
    assert not info.capabilities.samples_itself  # keys not given keep the conservative value
    assert info.options["transport"].type == "str" and info.options["transport"].choices == ("filesystem", "zmq")
    info.check_options({"transport": "zmq", "port": 80})
    with pytest.raises(ConfigError, match=r"backend.transport='pigeon' is not one of: filesystem, zmq"):
        info.check_options({"transport": "pigeon"})
    with pytest.raises(ConfigError, match=r"backend.port=0 is refused"):
        info.check_options({"port": 0})
    with pytest.raises(ConfigError, match=r"unknown config key 'backend.prot'.*known: port, transport"):
        info.check_options({"prot": 1})


def test_class_hooks_win_over_the_module_and_take_a_capabilities_and_option_specs():
    cls_info = describe_backend(f"{HOOKS}.ClassHookedBackend")
    assert cls_info.capabilities.resume_runtime_dependent and not cls_info.capabilities.preserves_token_advantages
    assert list(cls_info.options) == ["depth"] and cls_info.options["depth"].help == "how deep"
    from tests.plugins.backend_hooks import ClassHookedBackend

    assert capabilities_of(ClassHookedBackend) == cls_info.capabilities
    assert capabilities_of(ClassHookedBackend()) == cls_info.capabilities  # an instance: its class's


def test_a_capability_key_that_does_not_exist_is_named():
    with pytest.raises(ConfigError, match=r"unknown capabilities \['preserves_token_advantage'\]"):
        describe_backend(f"{HOOKS}.WrongCapabilityKeyBackend")


def test_a_target_that_does_not_import_is_a_config_error():
    with pytest.raises(ConfigError, match=r"backend._target_='nowhere.Backend' cannot be imported"):
        describe_backend("nowhere.Backend")


def test_a_subclass_of_a_builtin_is_a_plugin_and_must_declare_its_own():
    from retrain.backend.local import LocalBackend

    class Tweaked(LocalBackend):
        pass

    assert capabilities_of(LocalBackend).preserves_token_advantages
    assert capabilities_of(Tweaked) == CONSERVATIVE_CAPABILITIES


def test_backends_command_prints_the_table_and_json(tmp_path, cli_here: CliHere):
    text = cli_here(["backends"], cwd=tmp_path).stdout
    for name in BUILTIN_TABLE:
        assert f"\n{name}  (" in f"\n{text}"
    assert "backend.transport: str = 'filesystem' {filesystem|zmq}" in text
    assert all(hook in text for hook in HOOK_NAMES)
    payload = json.loads(cli_here(["backends", "--json", "--target", f"{HOOKS}.ModuleHookedBackend"], cwd=REPO).stdout)
    by_name = {entry["name"]: entry for entry in payload["backends"]}
    assert {
        name: tuple(
            by_name[name]["capabilities"][key]
            for key in (
                "reports_sync_loss",
                "preserves_token_advantages",
                "supports_checkpoint_resume",
                "resume_runtime_dependent",
            )
        )
        for name in BUILTIN_TABLE
    } == BUILTIN_TABLE
    assert by_name["tinker"]["install"] == "pip install 'retrain[tinker]'"
    assert isinstance(by_name["tinker"]["extra_installed"], bool)
    assert by_name["local"]["options"]["micro_batch_tokens"] == {
        "name": "micro_batch_tokens",
        "type": "int",
        "default": 8192,
        "choices": None,
        "required": False,
        "help": "padded tokens (prompt + completion) per forward/backward: rows are packed by length up to it, a "
        "longer row alone; bounds activation memory, never changes the gradient. 0 = all rows at once",
    }
    assert by_name[f"{HOOKS}.ModuleHookedBackend"]["source"] == "plugin/hook"
    assert payload["plugin_hooks"] == list(HOOK_NAMES)


def test_a_required_option_left_empty_is_named_before_anything_is_built():
    prime_rl = describe_backend("retrain.backend.prime_rl.backend.PrimeRlBackend")
    assert prime_rl.options["output_dir"].required
    for settings in ({}, {"output_dir": ""}):
        with pytest.raises(ConfigError, match=r"backend.output_dir is required: the PRIME-RL trainer's output_dir"):
            prime_rl.check_options(settings)
    prime_rl.check_options({"output_dir": "/runs/prime", "transport": "zmq"})
