"""The engine actor (fdcore:engine). For now it answers the control messages; its policy lands
with the serving path."""

from fdcore.actors.runtime import Actor


class EngineActor(Actor):
    pass
