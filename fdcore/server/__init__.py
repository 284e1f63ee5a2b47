"""fdcore's OpenAI-compatible HTTP front end (run by the ``fdcore:api`` actor)."""
