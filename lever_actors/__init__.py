"""lever_actors: a flash-resident LLM served by speculative token trees, as Trio actors.

Start with `lever_actors.engine.Engine` (trio) or `lever_actors.aio.AsyncEngine` (asyncio),
configured by `lever_actors.config.EngineConfig`; the `lever-actors` command wraps both.
"""

__version__ = "0.2.0"
