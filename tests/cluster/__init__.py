"""Tests against the two-host cluster (scripts/cluster.sh); a package so its conftest does not shadow tests/conftest.py."""
