"""Tests of serving policy."""
