"""The faults `pdserve bench chaos` knows (pdserve/bench/chaos.py), with no imports beyond
the standard library: the CLI lists them in its help."""

from __future__ import annotations

from types import MappingProxyType

STOP_S = 8.0  # a stopped worker stays stopped longer than the router's silence window (5 s)
FAULT_HELP = MappingProxyType(
    {
        "none": "no fault: the baseline",
        "decode-kill": "SIGKILL the busiest decode worker mid-stream",
        "decode-stop": f"SIGSTOP it for {STOP_S:g} s, then SIGCONT",
        "prefill-kill": "SIGKILL the busiest prefill worker",
        "prefill-stop": f"SIGSTOP it for {STOP_S:g} s, then SIGCONT",
        "router-restart": "SIGKILL the router; the supervisor starts it again",
        "cancel": "clients walk away from half of the streams mid-way",
        "black-hole": "a 'decode worker' that accepts connections and never answers registers",
    }
)
FAULTS = tuple(FAULT_HELP)
