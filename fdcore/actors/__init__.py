"""fdcore's actors: one per file, each a thin shell around a policy object.

Run one with ``python -m fdcore.actors KIND --id ID --instance ID --slot N --config FILE
--parent PID`` (the supervisor does this).
"""
