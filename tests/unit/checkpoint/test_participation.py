"""Who calls save_state/load_state (anyaccel/checkpoint/participation.py): the rules that need no
processes. The protocol itself runs with real processes in tests/multiprocess/test_diffusers_shapes.py
(two DDP processes saving on the main process only; FSDP2's error)."""

from __future__ import annotations

import types

from anyaccel.checkpoint import participation
from anyaccel.checkpoint.participation import _past, _problem


def test_a_process_is_further_on_when_it_did_more_or_left():
    here = (5, 10, 20)  # collectives, backward calls, batches of the process deciding
    assert not _past({"seq": 5, "backwards": 10, "batches": 20, "op": None}, here)  # where we are: it may still call
    assert _past({"seq": 6, "backwards": 10, "batches": 20}, here)  # in a collective we have not reached
    assert _past({"seq": 5, "backwards": 11, "batches": 20, "op": "backward (gradient all-reduce)"}, here)
    assert _past({"seq": 5, "backwards": 10, "batches": 21}, here)  # fetched the next batch (FSDP2: then all-gathers)
    assert _past({"missing": True, "left": {"code": 0}}, here)
    assert not _past({"missing": True, "left": None}, here)  # not answering yet: ask again


def test_what_stops_a_call_names_the_call_and_the_fix():
    away = {1: {"op": "backward (gradient all-reduce)", "stack": [{"file": "train.py", "line": 9, "code": "acc.backward(l)"}]}}
    sharded = _problem("save_state", "out/checkpoint-2", {}, away, "fsdp")
    assert sharded.startswith("save_state('out/checkpoint-2') was called by the main process alone")
    assert "the 'fsdp' strategy keeps the model and optimizer state sharded" in sharded
    assert "move the call out of the `if accelerator.is_main_process:` block" in sharded
    assert "process 1: it is in backward (gradient all-reduce) at train.py:9 (`acc.backward(l)`)" in sharded
    assert _problem("save_state", "d", {}, away, None) is None  # DDP: the main process saves alone
    assert _problem("save_state", "d", {1: {"what": "save_state"}}, {}, "fsdp") is None  # everyone: collective
    mixed = _problem("save_state", None, {1: {"what": "save_state"}}, {2: {"missing": True, "left": {"code": 1,
                                                                                                  "how": "x"}}}, None)
    assert mixed.startswith("save_state() was called by processes 0, 1 but not by the others (process 2: it left")
    other = _problem("save_state", "d", {1: {"what": "load_state", "directory": "d"}}, {}, None)
    assert "process 1: load_state('d')" in other and "every process must make the same call" in other


def test_one_process_and_no_store_take_the_usual_path():
    assert participation.alone("save_state", "d", 0, 1, None) is False
    ddp = types.SimpleNamespace(checkpoint_format="full", collective_state_dict=False)
    fsdp = types.SimpleNamespace(checkpoint_format="sharded", collective_state_dict=True)
    full_fsdp = types.SimpleNamespace(checkpoint_format="full", collective_state_dict=True)
    assert participation.full_state_on_main(ddp)
    assert not participation.full_state_on_main(fsdp) and not participation.full_state_on_main(full_fsdp)
