"""The OpenAI-compatible server: Litestar routes (app.py) over an engine that runs in a child process
(worker.py), started and watched as one engine_process.EngineProcess, restarted by the supervisor (supervisor.py).

    from strata_jax.config import EngineConfig, ServerConfig
    from strata_jax.serve import serve
    serve(ServerConfig(model="model.gguf", port=8000), EngineConfig(parallel=4, max_context=4096))
"""

from __future__ import annotations

from ..config import EngineConfig, ServerConfig


def build(server: ServerConfig, engine: EngineConfig, *, progress: bool = True):
    """The Litestar app, with its supervisor (the engine starts with the app)."""
    from .app import create_app
    from .console import Console
    from .supervisor import Supervisor

    if server.model is None:
        raise ValueError("ServerConfig.model is None: pass a GGUF path (the CLI fills in the default model)")
    template = None
    if server.chat_template_file:
        from pathlib import Path

        template = Path(server.chat_template_file).read_text(encoding="utf-8")
    sup = Supervisor(server.model, engine, console=Console(bars=progress), max_queue=server.max_queue,
                     stall_s=server.engine_stall_s, chat_template=template,
                     template_vars={} if server.reasoning is None else {"enable_thinking": server.reasoning != "off"},
                     prefill_assistant=server.prefill_assistant)
    return create_app(sup, server)


def serve(server: ServerConfig, engine: EngineConfig, *, progress: bool = True) -> int:
    """Run the server until interrupted (Ctrl-C / SIGTERM); the engine process ends with it."""
    import uvicorn

    app = build(server, engine, progress=progress)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:   # uvicorn shut down cleanly, then passes the Ctrl-C on
        pass
    return 0


__all__ = ["build", "serve"]
