"""What the hang doctor says when a collective finally fails in this process: the peer that left
(with its exit code and line), machine 0's store gone, a peer that dropped its connection without
leaving (SIGKILLed, its machine gone: named by the address gloo reports and the addresses every
rank publishes), or the last hang report. :func:`anyaccel.doctor.explain` calls it; local."""

from __future__ import annotations

import re
import socket
from typing import Any, Dict, List

from ..errors import CollectiveTimeoutError, PeerExitedError

__all__ = ["explain_failure"]

#: gloo's words for a peer whose socket was reset or closed, with the peer's address ``[a.b.c.d]:port``
_DROPPED = ("Connection reset by peer", "Connection closed by peer")
_PEER_ADDRESS = r"\[([0-9A-Fa-f:.]+)\]:\d+"  # compiled (and cached by re) at first use


def _peers_gone(doctor: Any, message: str) -> List[Dict[str, Any]]:
    """The ranks at the peer address in gloo's ``message`` when it says that peer dropped the
    connection (a process SIGKILLed, or its whole machine gone, never publishes ``left/<rank>``)."""
    match = re.search(_PEER_ADDRESS, message) if any(d in message for d in _DROPPED) else None
    if match is None or match.group(1) == getattr(doctor, "address", None):  # a peer on this machine: not named
        return []
    ranks: List[Dict[str, Any]] = doctor.ranks_at(match.group(1))
    return ranks


def explain_failure(doctor: Any, exc: BaseException, where: str) -> BaseException:
    """The error to raise instead of ``exc`` for ``doctor``'s rank, which waited in ``where`` (the
    collective, its number and the user's line); ``exc`` when nothing more is known. Local."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    try:
        left = doctor.peers_that_left()
    except Exception:  # noqa: BLE001 - explaining must not fail
        left = []
    if left:
        who = "; ".join(f"rank {p['rank']} left the job with exit code {p['code']} ({p['how']}) after its "
                        f"collective #{p['seq']}" for p in left)
        return PeerExitedError(f"{who}, while rank {doctor.rank} waited in {where}. Every rank must call the same "
                               f"collectives: look at what rank {left[0]['rank']} skipped or returned early from.")
    if getattr(doctor, "store_unreachable", False):
        host, port = doctor._address
        return PeerExitedError(f"a peer closed its connection while rank {doctor.rank} ({socket.gethostname()}) waited in "
                               f"{where}, and the job's store on machine 0 ({host}:{port}) does not answer: machine 0 "
                               f"(or its processes) is gone. (torch.distributed said: {first})")
    dead = _peers_gone(doctor, first)
    if dead:
        who = ", ".join(f"rank {p['rank']} (pid {p.get('pid', '?')})" for p in dead)
        return PeerExitedError(f"{'one of ' if len(dead) > 1 else ''}{who} on {dead[0].get('host', 'host unknown')} "
                               f"({dead[0]['addr']}) dropped its connection without leaving the job, while rank "
                               f"{doctor.rank} ({socket.gethostname()}) waited in {where}: that process, or its machine, "
                               f"is gone (killed, out of memory, machine down). (torch.distributed said: {first})")
    if doctor.last_report:
        return CollectiveTimeoutError(f"rank {doctor.rank} gave up waiting in {where}.\n{doctor.last_report}\n"
                                      f"(torch.distributed said: {first})")
    return exc
