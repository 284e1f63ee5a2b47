"""The cache actor (fdcore:cache). For now it answers the control messages; its policy lands
with the serving path."""

from fdcore.actors.runtime import Actor


class CacheActor(Actor):
    pass
