"""Tests of what is on disk."""
