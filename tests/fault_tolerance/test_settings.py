"""The fault_tolerance option and a worker's settings (anyaccel/fault_tolerance/settings.py): one row,
one check and one wording from every entry point; what a worker must be told; torchft missing."""

from __future__ import annotations

import sys

import pytest

from anyaccel import envvars, optionspec
from anyaccel.errors import ConfigError, FaultToleranceError
from anyaccel.fault_tolerance.settings import FaultToleranceSettings, require_torchft, resolve_settings
from conftest import TESTS

ROW = optionspec.option("fault_tolerance")


@pytest.mark.parametrize("given, value", [("on", "on"), (True, "on"), ("yes", "on"), ("off", "off"), (False, "off"),
                                          ("127.0.0.1:29510", "127.0.0.1:29510"), ("http://lh:1", "lh:1"),
                                          ("[::1]:29510", "[::1]:29510")])
def test_the_option_takes_off_on_or_a_lighthouse_address(given, value):
    assert optionspec.check(ROW, given, "fault_tolerance") == value


@pytest.mark.parametrize("given", ["lighthouse", "host:0", "host:99999", "::1:5", "a b:1", "h:1/x", 3])
def test_a_bad_value_is_refused_with_the_one_wording_from_each_entry_point(given, monkeypatch):
    with pytest.raises(ConfigError, match=r"fault_tolerance has the value .*; allowed: off, on \(anyaccel launch"):
        optionspec.check(ROW, given, "fault_tolerance")
    if isinstance(given, str) and " " not in given:
        with pytest.raises(ConfigError, match=r"ANYACCEL_FAULT_TOLERANCE has the value"):
            envvars.worker_settings({"ANYACCEL_FAULT_TOLERANCE": given})


def test_off_is_none_and_on_without_the_launcher_says_to_start_it_or_give_an_address():
    assert resolve_settings("off", 1, {}) is None
    with pytest.raises(FaultToleranceError, match=r"anyaccel launch --fault_tolerance on .*HOST:PORT"):
        resolve_settings("on", 1, {})


def test_an_address_needs_the_group_and_the_number_of_groups():
    with pytest.raises(FaultToleranceError, match="ANYACCEL_REPLICA_GROUP .*ANYACCEL_REPLICA_GROUPS"):
        resolve_settings("127.0.0.1:29510", 1, {"ANYACCEL_REPLICA_GROUP": "0"})
    settings = resolve_settings("127.0.0.1:29510", 2, {"ANYACCEL_REPLICA_GROUP": "1", "ANYACCEL_REPLICA_GROUPS": "3"})
    assert (settings.lighthouse, settings.group, settings.groups, settings.min_replicas) == \
        ("http://127.0.0.1:29510", 1, 3, 2)


def test_torchfts_timeout_variables_set_the_settings_the_gloo_group_takes_too():
    """TORCHFT_TIMEOUT_SEC bounds the gloo group's operations too (made with ``timeout_s``): a
    machine that vanishes without closing its sockets holds the all-reduce in flight that long."""
    group = {"ANYACCEL_REPLICA_GROUP": "0", "ANYACCEL_REPLICA_GROUPS": "2"}
    default = resolve_settings("h:1", 1, group)
    assert (default.timeout_s, default.quorum_timeout_s) == (60.0, 120.0)
    told = resolve_settings("h:1", 1, {**group, "TORCHFT_TIMEOUT_SEC": "5", "TORCHFT_QUORUM_TIMEOUT_SEC": "30"})
    assert (told.timeout_s, told.quorum_timeout_s) == (5.0, 30.0)


def test_a_loopback_store_is_not_what_other_machines_are_told():
    from anyaccel.environment.network import names_this_machine  # what Replica._store asks

    assert names_this_machine("127.0.0.1") and names_this_machine("localhost") and names_this_machine("::1")
    assert not names_this_machine("192.0.2.10") and not names_this_machine("aa-host0")


@pytest.mark.parametrize("fields, message", [(dict(group=2, groups=2), r"group must be in 0\.\.1"),
                                             (dict(group=0, groups=2, min_replicas=3), "no step could ever commit")])
def test_impossible_settings_name_the_value_and_the_fix(fields, message):
    with pytest.raises(FaultToleranceError, match=message):
        FaultToleranceSettings(lighthouse="h:1", **fields)


def test_the_mesh_knows_its_replica_group_and_loaders_shard_over_every_group_dead_or_alive():
    from anyaccel.strategies.mesh import ProcessMesh

    one = ProcessMesh.flat(1, 0)
    one.manage_replicas(1, 3)
    assert one.loader_shard() == (1, 3) and "replica group 1 of 3" in repr(one)  # group g reads share g of 3
    fsdp = ProcessMesh.flat(2, 1, dim="dp_shard")  # FSDP2 over a group's 2 processes
    fsdp.manage_replicas(1, 2)
    assert fsdp.loader_shard() == (3, 4) and fsdp.size("batch") == 2 and fsdp.world_size == 2  # torch's: the group
    with pytest.raises(ValueError, match=r"replica group 2 of 2: the group must be in 0\.\.groups-1"):
        fsdp.manage_replicas(2, 2)


def test_a_missing_torchft_says_how_to_install_the_pinned_release_at_every_entry(monkeypatch):
    import importlib.util

    sys.path.insert(0, str(TESTS / "launch"))  # the launch tests' helpers
    from test_plan import plan

    from anyaccel.launch.plan import PlanError

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    install = r"pip install 'anyaccel\[ft\]'.*torchft==0\.2\.0"
    with pytest.raises(FaultToleranceError, match=install):
        require_torchft()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(PlanError, match=install + r".* \(from --fault_tolerance\)"):  # the launcher, before anything
        plan(num_processes=2, fault_tolerance="on")
    env = {"ANYACCEL_REPLICA_GROUP": "0", "ANYACCEL_REPLICA_GROUPS": "2"}
    with pytest.raises(FaultToleranceError, match=install):  # a worker, at Accelerator()
        resolve_settings("127.0.0.1:1", 1, env)


def test_the_accelerator_argument_on_without_the_launcher_is_refused_before_training():
    from anyaccel import Accelerator

    with pytest.raises(FaultToleranceError, match="anyaccel launch --fault_tolerance on"):
        Accelerator(cpu=True, fault_tolerance="on")


@pytest.mark.parametrize("value", ["5.5", "", "abc", "0", "-3"])
def test_a_timeout_torchft_cannot_read_is_refused_naming_the_variable(value):
    """torchft 0.2.0's Manager reads TORCHFT_TIMEOUT_SEC itself as ``int(value)``: "5.5" or "" made it
    raise a ValueError that the replica reported as an unreachable Lighthouse (ftreview)."""
    group = {"ANYACCEL_REPLICA_GROUP": "0", "ANYACCEL_REPLICA_GROUPS": "2"}
    for variable in ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC"):
        with pytest.raises(FaultToleranceError, match=f"{variable} is {value!r}: torchft reads it as a whole number"):
            resolve_settings("h:1", 1, {**group, variable: value})


@pytest.mark.parametrize("field", ["timeout_s", "quorum_timeout_s"])
def test_a_timeout_that_is_not_positive_is_refused(field):
    with pytest.raises(FaultToleranceError, match=f"{field} is 0: it must be a positive number of seconds"):
        FaultToleranceSettings(lighthouse="h:1", group=0, groups=1, **{field: 0})
