"""What both clients are: a tree (started here, or found running), a claimed slot in it and the router that
reads the slot."""

from __future__ import annotations

import os

from fdcore.client.connection import Connection
from fdcore.client.router import Router
from fdcore.client.tree import Tree, check_health
from fdcore.config import Config, ConfigError, load_config
from fdcore.protocol import Welcome

INITIAL_WINDOW = 4096  # requests LLM.generate keeps in flight before the engine says how many fit


class Client:
    """What both clients are: a tree (started here, or found running), a claimed slot in it and
    the router that reads the slot."""

    def __init__(self, config=None, *, start_timeout: float = 300.0, tree: Tree | None = None):
        """Start a tree for ``config`` (a TOML path, a Config, or None: the defaults), or use ``tree``, one
        already running (:meth:`connect` finds it; an actor of the tree names its own)."""
        self._tree = tree or Tree.start(config, start_timeout)
        try:
            self._conn = Connection(self._tree)
        except BaseException:
            if tree is None:
                self._tree.stop()
            raise
        self._router = Router(self._tree, self._conn)
        self._window = pending_limit(config) if tree is None else INITIAL_WINDOW

    @classmethod
    def connect(cls, instance: str | None = None):
        """Attach to a tree started with ``python -m fdcore.supervisor --config``."""
        return cls(tree=Tree.find(instance))

    @property
    def instance(self) -> str:
        return self._tree.instance

    @property
    def welcome(self) -> Welcome:
        """What the engine said of itself when this client connected: the model, its context length and
        sampling defaults."""
        return self._conn.welcome

    def health(self, stale_after: float = 10.0) -> tuple[bool, str]:
        """(True, "") while the tree is ready and every actor ticks within ``stale_after`` seconds; else
        (False, why)."""
        return check_health(self._tree, stale_after)

    def _close(self) -> None:
        self._router.close()
        self._conn.close()
        self._tree.stop()


def pending_limit(config) -> int:
    """engine.max_pending_requests of a config we start a tree with (a file we cannot read: the
    default; the supervisor will say why)."""
    if isinstance(config, Config):
        return config.engine.max_pending_requests
    if config is None:
        return Config().engine.max_pending_requests
    try:
        return load_config(os.fspath(config), check_model=False).engine.max_pending_requests
    except ConfigError:
        return INITIAL_WINDOW
