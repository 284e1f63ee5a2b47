"""Tests of the shared-memory transport."""
