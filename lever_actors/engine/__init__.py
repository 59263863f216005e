"""The engine: `Engine` (trio) and `AsyncEngine` (asyncio) load the models once under the
start-up plan (plan/start.py), then serve requests, several at once.

engine.py opens and serves; loading.py loads in the plan's order; crew.py runs the actors
every request shares, wiring.py each request's own; batch.py keeps the places of the
requests decoding at once; state.py is a request's state and KV caches, intake.py its text
encoded and its grammar's matcher; steps.py is a request's loop; prefix_cache.py keeps
finished requests' KV; results.py gathers a request's events; aio.py bridges to asyncio."""

from lever_actors.engine.aio import AsyncEngine
from lever_actors.engine.engine import Engine, GenerationResult, LoadTimes

__all__ = ["AsyncEngine", "Engine", "GenerationResult", "LoadTimes"]
