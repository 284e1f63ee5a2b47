"""Tests of the actor tree: supervisor, crash-resume, clients, command line."""
