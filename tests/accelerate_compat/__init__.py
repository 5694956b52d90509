"""Accelerate 1.15's distributed test scripts, run against Accelerate and anyaccel (see harness.py)."""
