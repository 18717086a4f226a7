"""PluginSwitch, the on/off state the mlx-lm and SGLang plug-ins share."""

import pytest

from mlx_batched_decode.integrations.switch import PluginSwitch


class Patches:
    def __init__(self, tag="a"):
        self.tag = tag
        self.restored = 0

    def restore(self):
        self.restored += 1


def test_turn_on_applies_once_and_checks_the_rest():
    switch = PluginSwitch("[test]")
    seen = []
    switch.turn_on(lambda: Patches("a"))
    first = switch.active
    switch.turn_on(lambda: Patches("b"), seen.append)
    assert switch.active is first and seen == [first]

    def refuse(active):
        raise ValueError("other settings")

    with pytest.raises(ValueError, match="other settings"):
        switch.turn_on(lambda: Patches("b"), refuse)
    assert switch.active is first


def test_turn_off_restores_once():
    switch = PluginSwitch("[test]")
    switch.turn_off()
    switch.turn_on(Patches)
    patches = switch.active
    switch.turn_off()
    switch.turn_off()
    assert switch.active is None and patches.restored == 1


def test_on_during_leaves_a_switch_that_was_on_on():
    switch = PluginSwitch("[test]")
    with switch.on_during(lambda: switch.turn_on(Patches)):
        inner = switch.active
        assert inner is not None
    assert switch.active is None and inner.restored == 1

    switch.turn_on(Patches)
    outer = switch.active
    with switch.on_during(lambda: switch.turn_on(Patches)):
        assert switch.active is outer
    assert switch.active is outer and outer.restored == 0


def test_on_during_turns_off_after_an_error():
    switch = PluginSwitch("[test]")
    with pytest.raises(RuntimeError):
        with switch.on_during(lambda: switch.turn_on(Patches)):
            raise RuntimeError("in the block")
    assert switch.active is None


def test_require_names_the_caller():
    switch = PluginSwitch("[test]")
    with pytest.raises(ValueError, match=r"\[test\] stats\(\) needs the plug-in enabled"):
        switch.require("stats()")
    switch.turn_on(Patches)
    assert switch.require("stats()") is switch.active
