"""`lever-actors serve`: an OpenAI-compatible HTTP server over one Engine.

The routes are a Starlette application (app.py) over the request and response bodies of
schemas.py; hypercorn's trio worker serves it in the engine's own trio run, so a request
handler awaits the engine directly.
"""

from __future__ import annotations

import hypercorn.config
import hypercorn.trio
import trio

from lever_actors.config import DEFAULT_MAX_NEW_TOKENS, EngineConfig
from lever_actors.engine import Engine
from lever_actors.progress import Progress
from lever_actors.serve.app import build_app


async def serve(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "lever",
    queue: int = 8,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the engine and serve it until cancelled; `task_status.started` gets the bound
    addresses ("http://127.0.0.1:8000"; port 0 binds a free one)."""
    async with Engine.open(config, progress=progress) as engine:
        app = build_app(
            engine,
            model_name=model_name,
            queue=queue,
            api_key=api_key,
            default_max_tokens=default_max_tokens,
        )
        settings = hypercorn.config.Config()
        settings.bind = [f"{host}:{port}"]
        settings.accesslog = None
        # hypercorn types an ASGI app narrower than Starlette's (pgjones/hypercorn#353)
        await hypercorn.trio.serve(app, settings, task_status=task_status)  # type: ignore[arg-type]
