"""The OpenAI-compatible server: Litestar routes (app.py) over an engine that runs in a child
process (worker.py), started and watched as one engine_process.EngineProcess, restarted by the
supervisor (supervisor.py).

    from strata_jax.config import EngineConfig, ServerConfig
    from strata_jax.serve import serve
    serve(ServerConfig(model="model.gguf", port=8000), EngineConfig(parallel=4, max_context=4096))
"""

from __future__ import annotations

from ..config import EngineConfig, ServerConfig


def build(server: ServerConfig, engine: EngineConfig, *, progress: bool = True):
    """The Litestar app, with its supervisor (the engine starts with the app)."""
    from .app import create_app
    from .http.console import Console
    from .supervisor.supervisor import Supervisor

    if server.model is None:
        raise ValueError("ServerConfig.model is None: pass a GGUF path (the CLI fills in the "
                         "default model)")
    template = None
    if server.chat_template_file:
        from pathlib import Path

        template = Path(server.chat_template_file).read_text(encoding="utf-8")
    elif server.chat_template:                   # one of llama.cpp's names, or the template itself
        from ..gguf.named_templates import chat_template_source

        template = chat_template_source(server.chat_template)
    sup = Supervisor(server.model, engine, console=Console(bars=progress),
                     max_queue=server.max_queue, stall_s=server.engine_stall_s,
                     chat_template=template,
                     template_vars={} if server.reasoning is None
                                   else {"enable_thinking": server.reasoning != "off"},
                     prefill_assistant=server.prefill_assistant,
                     template_dates=server.llama_conventions,
                     reasoning_budget=server.reasoning_budget)
    return create_app(sup, server)


def serve(server: ServerConfig, engine: EngineConfig, *, progress: bool = True) -> int:
    """Run the server until interrupted (Ctrl-C / SIGTERM); the engine process ends with it."""
    import uvicorn

    from .http.slow_clients import protocol

    # first: a bad address fails before the engine starts
    sockets = listen_sockets(server.host, server.port)
    app = build(server, engine, progress=progress)
    # uvicorn's h11 protocol, whatever else is installed: h11 writes header names as the app gives
    # them (llama.cpp's `Access-Control-Allow-Origin`: serve/http/cors.py), where httptools (which
    # Ray's packages bring) lowercases them; with a deadline on reading each request
    # (--read-timeout-s: slow_clients.py)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info",
                            access_log=False,
                            timeout_graceful_shutdown=5, http=protocol(server.read_timeout_s))
    try:
        uvicorn.Server(config).run(sockets=sockets)
    except KeyboardInterrupt:   # uvicorn shut down cleanly, then passes the Ctrl-C on
        pass
    return 0


__all__ = ["build", "serve"]


def listen_sockets(hosts: str, port: int) -> list:
    """A listening socket for each address of `hosts` (one, or a comma list as llama.cpp's --host
    a,b; an IPv6 address bare or in brackets), all on `port`. An address that cannot be bound is an
    error naming it."""
    import socket

    out = []
    for host in (h.strip().strip("[]") for h in hosts.split(",")):
        if not host:
            continue
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port,
                                                              type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # this address only; 127.0.0.1 may have its own socket
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
        except OSError as e:
            for s in out:
                s.close()
            raise ValueError(f"--host {host!r} (port {port}): cannot listen there "
                             f"({e.strerror or e})") from None
        out.append(sock)
    if not out:
        raise ValueError(f"--host {hosts!r}: no address to listen on")
    return out

