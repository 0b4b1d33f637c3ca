"""The engine process: `python -m strata_jax.serve.worker`, driven by the server over stdin/stdout frames
(see protocol.py); its stderr is the engine's log, read by the server.

Threads: the main thread reads commands from stdin and answers `prepare` and `stats` itself (tokenizing
is quick); each submitted request gets a thread that forwards its events; a heartbeat thread says every
BEAT_S seconds how long ago the engine loop last moved (see `heartbeat`), for the server's watchdog; every
write to stdout goes through one lock. If the engine loop's thread ever ends, the process prints an ERR line
and exits, so that the server starts a new engine instead of keeping one that takes requests and never
answers. stdout is reserved for frames: fd 1 is pointed at stderr before anything else runs, so
a stray print (ours, a library's) cannot corrupt the stream. When stdin closes (the server went away) the
process ends. Errors that end the process are printed as one `ERR ...` line first, so the server can say why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from .protocol import pack, read_frame
from .tools import tool_prompt
from .worker_prompts import (
    bias_ids,
    max_token_bytes,
    render_chat,
    render_options,
    sampling,
    template_kwargs,
)

log = logging.getLogger("strata_jax.serve.worker")

BEAT_S = 1.0

class Writer:
    def __init__(self, out: BinaryIO):
        self._out = out
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        data = pack(msg)
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError):   # the server is gone: nothing left to do
                os._exit(0)


def main() -> int:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("gguf", "jax"):       # GGUFWriter's chatter; jax's "Unable to initialize backend 'tpu'"
        logging.getLogger(noisy).setLevel(logging.WARNING)
    writer = Writer(out)
    start = read_frame(sys.stdin.buffer)
    if start is None:
        return 0
    try:
        worker = Worker(start, writer)
    except BaseException as e:  # noqa: BLE001 - said on one line, then the process ends
        traceback.print_exc()
        print(f"ERR engine start: {type(e).__name__}: {_one_line(e)}", file=sys.stderr, flush=True)
        return 1
    worker.serve(sys.stdin.buffer)
    return 0


class Worker:
    def __init__(self, start: dict[str, Any], writer: Writer):
        from strata_jax import compile_cache
        from strata_jax.config import EngineConfig
        from strata_jax.engine import Engine
        from strata_jax.gguf import GGUFModel

        self.writer = writer
        t0 = time.monotonic()
        cfg = EngineConfig.from_dict(start["engine"])
        model = GGUFModel.open(start["model"])
        with _progress_as_frames(writer):
            self.engine = Engine(model, cfg, progress=True)     # loads the weights, builds the decode programs
        if start.get("chat_template"):          # --chat-template-file: this template instead of the model's
            self.engine.tokenizer.chat_template = start["chat_template"]
            self.engine.tokenizer._template = None
        self.handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.engine.on_loop_death = _exit_with_error
        spec = self.engine.spec
        programs = self.engine.stats().get("programs", {})
        writer.send({"t": "ready", "info": {
            "architecture": spec.architecture, "name": model.metadata.get("general.name"),
            "n_ctx": cfg.max_context, "parallel": cfg.parallel, "vocab_size": spec.vocab_size,
            "n_experts": getattr(spec, "n_experts", 0),
            "chat_template": self.engine.tokenizer.chat_template is not None,
            "chat_template_source": self.engine.tokenizer.chat_template,     # GET /props shows these three
            "bos_token": self.engine.tokenizer.bos_token, "eos_token": self.engine.tokenizer.eos_token,
            "eos_ids": sorted(self.engine.tokenizer.eos_ids),
            "start_s": round(time.monotonic() - t0, 3), "programs_built": programs.get("built", 0),
            "build_s": programs.get("build_seconds", 0.0), "pid": os.getpid(),
            "choices": self.engine.runner.choices, "max_token_bytes": max_token_bytes(self.engine.tokenizer),
            "compile_cache": compile_cache.counters(),
        }})
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()

    def heartbeat(self) -> None:
        """Every BEAT_S: {"t": "beat", "stuck_s", "compiling", "loop"}. stuck_s: seconds since the engine
        loop last began a turn (it begins one at least every half second when idle, and after every window).
        A program build is progress however long it takes: while the engine thread is lowering or
        compiling (see `_in_build`), stuck_s is 0. A stopped process (SIGSTOP)
        sends nothing: the server's watchdog sees the silence itself."""
        eng = self.engine
        while True:
            time.sleep(BEAT_S)
            thread = eng._thread
            compiling = thread is not None and _in_build(thread)
            stuck = 0.0 if compiling or thread is None else max(time.monotonic() - eng.progress_at, 0.0)
            self.writer.send({"t": "beat", "stuck_s": round(stuck, 3), "compiling": compiling,
                              "loop": "none" if thread is None else ("alive" if thread.is_alive() else "ended")})

    # ---- commands -------------------------------------------------------------------------------------

    def serve(self, inp: BinaryIO) -> None:
        while True:
            cmd = read_frame(inp)
            if cmd is None or cmd.get("op") == "shutdown":
                break
            try:
                self.handle(cmd)
            except Exception as e:  # a bad command must not end the engine
                log.exception("command %s failed", cmd.get("op"))
                if "id" in cmd:
                    self.writer.send({"t": "rejected", "id": cmd["id"], "kind": "internal",
                                      "message": f"the engine could not take the request: {_one_line(e)}"})
        self.engine.close()
        os._exit(0)

    def handle(self, cmd: dict[str, Any]) -> None:
        op = cmd["op"]
        if op == "prepare":
            self.writer.send(self.prepare(cmd))
        elif op == "submit":
            self.submit(cmd)
        elif op == "cancel":
            with self._lock:
                h = self.handles.get(cmd["id"])
            if h is not None:
                h.cancel()
        elif op == "expert_profile":      # a thread of its own: commands keep flowing while it waits a window
            threading.Thread(target=self._save_profile, args=(cmd,), name="expert-profile", daemon=True).start()
        elif op == "stats":
            self.writer.send({"t": "stats", "id": cmd["id"], "stats": self._stats()})
        elif op in ("tokenize", "detokenize"):      # llama.cpp's routes: quick, like prepare
            from .tokens import answer

            self.writer.send(answer(self.engine.tokenizer, cmd))
        elif op == "apply_template":
            self.writer.send(self.apply_template(cmd))
        elif op == "slot":                  # llama.cpp's /slots/N?action=...: between windows, off this thread
            threading.Thread(target=self._slot_action, args=(cmd,), name="slot-file", daemon=True).start()
        else:
            raise ValueError(f"unknown command {op!r}")

    def _save_profile(self, cmd: dict[str, Any]) -> None:
        """The engine thread hands over a copy of the counts between windows; the file is written here, into
        the directory the server chose (created 0o700), through a private temporary file."""
        rid = cmd["id"]
        try:
            out = self.engine.save_expert_profile(cmd["path"], private_dir=True)
        except ValueError as e:                 # a model without experts
            self.writer.send({"t": "rejected", "id": rid, "kind": "invalid", "param": "name", "message": str(e)})
        except OSError as e:                    # the server's directory cannot be written: said without its path
            log.error("the expert profile was not written to %s: %s", cmd["path"], e)
            self.writer.send({"t": "rejected", "id": rid, "kind": "server", "message": "the expert profile was not "
                              f"written: {e.strerror or type(e).__name__} (the server's log has the details)"})
        except Exception:
            log.exception("the expert profile was not written")
            self.writer.send({"t": "rejected", "id": rid, "kind": "internal", "message": "the expert profile "
                              "was not written"})
        else:
            self.writer.send({"t": "saved", "id": rid, **out})

    def apply_template(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's /apply-template: the prompt text a chat renders to, as prepare renders it."""
        from strata_jax.gguf.chat_template import NoChatTemplateError

        rid, messages, p = cmd["id"], cmd["prompt"], cmd.get("params") or {}
        kwargs = template_kwargs(cmd)
        try:
            if p.get("tools"):
                messages, kwargs, _ = tool_prompt(self.engine.tokenizer, messages, kwargs, *p["tools"])
            text = render_chat(self.engine.tokenizer, messages, kwargs, *render_options(cmd, p))
        except NoChatTemplateError as e:
            return {"t": "rejected", "id": rid, "kind": "template", "message": str(e)}
        except ValueError as e:
            return {"t": "rejected", "id": rid, "kind": "invalid", "message": str(e), "param": "messages"}
        return {"t": "answer", "id": rid, "prompt": text}

    def _slot_action(self, cmd: dict[str, Any]) -> None:
        from strata_jax.engine import slot_files

        rid = cmd["id"]
        try:
            out = slot_files.run(self.engine, cmd["action"], cmd["slot"], cmd.get("path"))
        except slot_files.SlotFileError as e:
            self.writer.send({"t": "rejected", "id": rid, "kind": "invalid", "param": "filename", "message": str(e)})
        except OSError as e:
            log.error("slot file %s: %s", cmd.get("path"), e)
            self.writer.send({"t": "rejected", "id": rid, "kind": "server", "message": "the slot file could not be "
                              f"{'written' if cmd['action'] == 'save' else 'read'}: {e.strerror or type(e).__name__}"})
        except Exception:
            log.exception("slot action %s failed", cmd.get("action"))
            self.writer.send({"t": "rejected", "id": rid, "kind": "internal", "message": "the slot action failed"})
        else:
            self.writer.send({"t": "answer", "id": rid, **out})

    def _stats(self) -> dict[str, Any]:
        for _ in range(3):      # read while the engine thread changes its dicts: a rare "changed size" error
            try:
                return self.engine.stats()
            except RuntimeError:
                time.sleep(0.01)
        return self.engine.stats()

    def prepare(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Tokenize and check a request without queueing it: the server answers 4xx at once, and holds the
        queue itself (so a request that waits for a slot survives an engine restart)."""
        from strata_jax.engine import ContextOverflowError, RequestError
        from strata_jax.engine.request import make_params
        from strata_jax.gguf.chat_template import NoChatTemplateError

        rid, prompt, p = cmd["id"], cmd["prompt"], cmd["params"]
        kwargs = template_kwargs(cmd)
        n_ctx = self.engine.config.max_context
        tooling = {}
        try:
            think = False
            if p.get("tools") and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt, kwargs, tooling = tool_prompt(self.engine.tokenizer, prompt, kwargs, *p["tools"])
                if tooling.get("grammar"):
                    p = {**p, "grammar": tooling["grammar"]}
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                # Rendered once: the text is tokenized and says whether the template opened the reasoning
                # part. kwargs go over the defaults: the server lets them name messages or
                # add_generation_prompt only with --trust-request-chat-template.
                text = render_chat(self.engine.tokenizer, prompt, kwargs, *render_options(cmd, p))
                think = text.rstrip().endswith("<think>")
                ids = self.engine.chat_text_ids(text)
            elif isinstance(prompt, list) and any(isinstance(x, str) for x in prompt):   # llama.cpp's mixed prompt
                from .tokens import answer as tokenize

                got = tokenize(self.engine.tokenizer, {"op": "tokenize", "id": rid, "content": prompt,
                                                       "add_special": True})
                if got["t"] != "answer":
                    return got
                ids = got["tokens"]
            else:
                ids = self.engine.prompt_ids(prompt)
            if any(isinstance(k, str) for k, _ in p.get("logit_bias") or ()):    # llama.cpp's: a text's tokens
                tooling["logit_bias"] = p["logit_bias"] = bias_ids(self.engine.tokenizer, p["logit_bias"])
            max_tokens = p.get("max_tokens") or max(n_ctx - len(ids), 1)
            params = make_params(**sampling(p, max_tokens))
            params.validate(self.engine.spec.vocab_size)
            if params.grammar is not None:       # compiled here too: a schema it cannot compile is a 400
                self.engine.grammars.check(params.grammar)
            if len(ids) + max_tokens > n_ctx:
                raise ContextOverflowError(len(ids), max_tokens, n_ctx)
        except ContextOverflowError as e:
            return {"t": "rejected", "id": rid, "kind": "context", "message": str(e),
                    "n_prompt_tokens": e.prompt_tokens, "max_tokens": e.max_tokens, "n_ctx": e.n_ctx}
        except NoChatTemplateError as e:
            return {"t": "rejected", "id": rid, "kind": "template", "message": str(e)}
        except RequestError as e:
            field = str(e).split(" = ", 1)[0]
            return {"t": "rejected", "id": rid, "kind": "invalid", "message": str(e),
                    "param": field if field.isidentifier() else None}
        except ValueError as e:   # ChatMessageError, ChatTemplateError, TokenizerError
            return {"t": "rejected", "id": rid, "kind": "invalid", "message": str(e), "param": "messages"
                    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else "prompt"}
        out = {"t": "prepared", "id": rid, "ids": ids, "max_tokens": max_tokens, "think": think, **tooling}
        if cmd.get("text"):                       # llama.cpp's "__verbose": the prompt as the model reads it
            out["text"] = self.engine.tokenizer.decode(ids)
        return out

    def submit(self, cmd: dict[str, Any]) -> None:
        rid, p = cmd["id"], cmd["params"]
        h = self.engine.submit(cmd["ids"], **sampling(p, p["max_tokens"]), progress=bool(p.get("progress")))
        with self._lock:
            self.handles[rid] = h
        threading.Thread(target=self._forward, args=(rid, h), name=f"req-{rid}", daemon=True).start()

    def _forward(self, rid: str, h) -> None:
        try:
            for ev in h:
                msg: dict[str, Any] = {"t": "ev", "id": rid, "k": ev.kind, "x": ev.text, "tok": ev.token}
                if ev.logprob is not None:      # here, off the engine thread: the tokens' bytes (logprobs.py)
                    piece = self.engine.tokenizer.token_bytes
                    msg["lp"] = [piece(ev.token), ev.logprob, [[piece(t), v] for t, v in ev.top_logprobs or ()]]
                    msg["lpi"] = [ev.token, [t for t, _ in ev.top_logprobs or ()]]
                if ev.kind in ("final", "progress"):
                    msg["fr"], msg["st"] = ev.finish_reason, ev.stats
                elif ev.kind == "error":
                    msg["err"] = ev.error
                self.writer.send(msg)
        finally:
            with self._lock:
                self.handles.pop(rid, None)


def _exit_with_error(reason: str) -> None:
    """The engine loop's thread ended: say why on the ERR line and end the process (the server restarts it)."""
    print(f"ERR the engine loop stopped: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def _in_build(thread: threading.Thread) -> bool:
    """Whether `thread` is building a program now: a frame of our ProgramCache._build_one (or _wait_built, the
    same build on the builder thread), or of JAX lowering
    or compiling (a jit's first call, e.g. the sampler's for a new row count), is on its stack. Running a
    program is not building one: its frames (pxla's ExecuteReplicated) match neither."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("_build_one", "_wait_built") and code.co_filename.endswith("programs.py"):
            return True                        # _wait_built: waiting for the builder thread's compile of it
        if f"jax{os.sep}_src{os.sep}" in code.co_filename and ("compil" in code.co_name or "lower" in code.co_name):
            return True
        frame = frame.f_back
    return False


def _die_with_parent() -> None:
    """The server stops this process at shutdown; if the server is killed instead, Linux ends it too (the
    process has its own session, so terminal signals do not reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                  # not Linux: stdin closing still ends the process
    if os.getppid() == 1:                     # the server died before prctl
        os._exit(0)


@contextlib.contextmanager
def _progress_as_frames(writer: Writer):
    """The engine draws its progress (loading weights, building programs) with tqdm; here, in the engine
    process, each bar's updates become progress frames instead, and the server draws them."""
    import tqdm as tqdm_module

    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below

    class FrameBar(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": devnull, "mininterval": 0.25})

        def display(self, msg=None, pos=None):
            writer.send({"t": "progress", "stage": self.desc or "working", "n": int(self.n),
                         "total": int(self.total or 0)})
            return True

        def close(self):
            if not self.disable and not getattr(self, "_frame_closed", False):
                self._frame_closed = True
                self.display()
            super().close()

    saved = tqdm_module.tqdm
    tqdm_module.tqdm = FrameBar
    try:
        yield
    finally:
        tqdm_module.tqdm = saved
        devnull.close()


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
