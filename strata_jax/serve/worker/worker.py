"""The engine process: `python -m strata_jax.serve.worker.worker`, driven by the server over
stdin/stdout frames (see protocol.py); its stderr is the engine's log, read by the server.

Threads: the main thread reads commands from stdin, queues each submitted request (prepared by the
server: serve/prompts.py) and answers `stats` itself; a request with a grammar is compiled first on
a pool of threads (engine/grammar/grammar_compile.py compiles it once), so a grammar that takes
seconds holds up no one else's commands; /tokenize and /detokenize, slot files, embeddings and the
expert profile each get a thread (megabytes of text, or a wait for the engine thread, hold up no
other command; the server bounds how many wait: serve/supervisor/questions.py); each submitted
request gets a thread that forwards its events; a heartbeat thread says every BEAT_S seconds how
long ago the engine loop last moved (see `heartbeat`), for the server's watchdog; every write to
stdout goes through one lock (worker_process.Writer). If the engine loop's thread ever ends, the
process prints an ERR line and exits, so that the server starts a new engine instead of keeping one
that takes requests and never answers. stdout is reserved for frames: fd 1 is pointed at stderr
before anything else runs, so a stray print (ours, a library's) cannot corrupt the stream. When
stdin closes (the server went away) the process ends. Errors that end the process are printed as one
`ERR ...` line first, so the server can say why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from ..protocol import (
    Answer,
    Beat,
    Cancel,
    Command,
    Detokenize,
    Embed,
    EventFrame,
    FrameError,
    GetStats,
    Ready,
    Rejected,
    Saved,
    SaveExpertProfile,
    Shutdown,
    SlotAction,
    Start,
    Stats,
    Submit,
    Tokenize,
    decode_command,
    decode_start,
    read_frame,
)
from .worker_process import (
    Writer,
    die_with_parent,
    exit_with_error,
    in_build,
    one_line,
    progress_as_frames,
    storage_reads,
    stuck_seconds,
)

log = logging.getLogger("strata_jax.serve.worker.worker")

BEAT_S = 1.0


def main() -> int:
    die_with_parent()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    # GGUFWriter's chatter; jax's "Unable to initialize backend 'tpu'"
    for noisy in ("gguf", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    writer = Writer(out)
    try:
        start = read_frame(sys.stdin.buffer, decode_start)
        if start is None:
            return 0
        worker = Worker(start, writer)
    except BaseException as e:  # noqa: BLE001 - said on one line, then the process ends
        traceback.print_exc()
        print(f"ERR engine start: {type(e).__name__}: {one_line(e)}", file=sys.stderr, flush=True)
        return 1
    worker.serve(sys.stdin.buffer)
    return 0


class Worker:
    def __init__(self, start: Start, writer: Writer):
        from strata_jax.config import EngineConfig
        from strata_jax.engine import Engine
        from strata_jax.engine.distributed.hosts import join
        from strata_jax.gguf import GGUFModel

        from .group import exit_group_lost

        self.writer = writer
        t0 = time.monotonic()
        cfg = EngineConfig.from_dict(start.engine)
        # one model over processes (engine/distributed/hosts.py): before JAX starts its backend
        join(cfg)
        model = GGUFModel.open(start.model)
        with progress_as_frames(writer):
            # loads the weights, builds the decode programs
            self.engine = Engine(model, cfg, progress=True)
        # --chat-template(-file): this template instead of the model's
        if start.chat_template:
            self.engine.tokenizer.use_chat_template(start.chat_template)
        self.handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        # threads for submits that compile a grammar (made at the first), the ids they compile, and
        # those of them a Cancel came for meanwhile
        self._grammar_pool = None
        self._compiling: set[str] = set()
        self._cancelled_early: set[str] = set()
        # the loop thread dead, or a process of the group gone (serve/worker/group.py): this process
        # ends
        self.engine.when_lost(exit_with_error, exit_group_lost)
        writer.send(Ready(self.ready_info(model, time.monotonic() - t0)))
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()

    def ready_info(self, model: Any, start_s: float) -> dict[str, Any]:
        """What the server shows of this engine: GET /props, /v1/models, the console's ready
        line."""
        from strata_jax import compile_cache
        from strata_jax.engine.execute.embeddings import model_pooling

        eng, cfg, spec, tk = (self.engine, self.engine.config, self.engine.spec,
                              self.engine.tokenizer)
        programs = eng.stats().get("programs", {})
        return {
            "architecture": spec.architecture, "name": model.metadata.get("general.name"),
            "n_ctx": cfg.max_context, "parallel": cfg.parallel, "vocab_size": spec.vocab_size,
            "n_experts": getattr(spec, "n_experts", 0),
            "chat_template": tk.chat_template is not None,
            "chat_template_source": tk.chat_template,     # GET /props shows these three
            "bos_token": tk.bos_token, "eos_token": tk.eos_token, "eos_ids": sorted(tk.eos_ids),
            "start_s": round(start_s, 3), "programs_built": programs.get("built", 0),
            "build_s": programs.get("build_seconds", 0.0), "pid": os.getpid(),
            "choices": eng.runner.choices,
            "compile_cache": compile_cache.counters(),
            "pooling": model_pooling(model.metadata, spec.architecture),     # --pooling auto's
        }

    def heartbeat(self) -> None:
        """Every BEAT_S a Beat. stuck_s: seconds since the engine loop last began a turn (it begins
        one at least every half second when idle, and after every window) or the process last read
        from storage (worker_process.storage_reads: a window of a model larger than RAM waits on its
        file for a long time, moving). A program build is progress however long it takes: while
        the engine thread is lowering or compiling (see worker_process.in_build), stuck_s is 0. A
        stopped process (SIGSTOP) sends nothing: the server's watchdog sees the silence itself."""
        eng = self.engine
        reads, reading_at = storage_reads(), 0.0
        while True:
            time.sleep(BEAT_S)
            thread = eng.loop_thread
            compiling = thread is not None and in_build(thread)
            # a window waiting on the model file (reads from storage growing) is moving, however
            # slowly: the watchdog must not kill it
            now_reads = storage_reads()
            if reads is not None and now_reads is not None and now_reads > reads:
                reading_at = time.monotonic()
            reads = now_reads
            stuck = stuck_seconds(time.monotonic(), eng.progress_at, reading_at,
                                  compiling or thread is None)
            loop = "none" if thread is None else ("alive" if thread.is_alive() else "ended")
            self.writer.send(Beat(round(stuck, 3), compiling, loop))

    # ---- commands --------------------------------------------------------------------------------

    def serve(self, inp: BinaryIO) -> None:
        while True:
            try:
                cmd = read_frame(inp, decode_command)
            # the server's bug: said, answered when it names an id, skipped
            except FrameError as e:
                log.error("%s", e)
                if e.id is not None:
                    self.writer.send(Rejected(e.id, "internal", str(e)))
                continue
            if cmd is None or isinstance(cmd, Shutdown):
                break
            try:
                self.handle(cmd)
            except Exception as e:  # a bad command must not end the engine
                log.exception("command %s failed", type(cmd).__name__)
                if hasattr(cmd, "id"):
                    self.writer.send(Rejected(cmd.id, "internal",
                                              "the engine could not take the request: "
                                              f"{one_line(e)}"))
        self.engine.close()
        os._exit(0)

    def handle(self, cmd: Command) -> None:
        match cmd:
            case Submit() if cmd.sampling.grammar is not None:
                # compiling waits there, not here
                with self._lock:
                    self._compiling.add(cmd.id)
                self._grammar_submits().submit(self._submit_apart, cmd)
            case Submit():
                self.submit(cmd)
            # a request's, or an embedding's the server gave up on (its Event)
            case Cancel():
                with self._lock:
                    h = self.handles.get(cmd.id)
                    if h is None and cmd.id in self._compiling:
                        self._cancelled_early.add(cmd.id)
                if h is not None:
                    (h.set if isinstance(h, threading.Event) else h.cancel)()
            # a thread of its own: commands keep flowing while it waits a window
            case SaveExpertProfile():
                threading.Thread(target=self._save_profile, args=(cmd,), name="expert-profile",
                                 daemon=True).start()
            case GetStats():
                self.writer.send(Stats(cmd.id, self._stats()))
            # a thread of its own: megabytes of text take seconds (tokens.py)
            case Tokenize() | Detokenize():
                threading.Thread(target=self._tokens, args=(cmd,), name="tokenize",
                                 daemon=True).start()
            # llama.cpp's /slots/N?action=...: between windows, off this thread
            case SlotAction():
                threading.Thread(target=self._slot_action, args=(cmd,), name="slot-file",
                                 daemon=True).start()
            case Embed():               # between windows too
                threading.Thread(target=self._embed, args=(cmd,), name="embed", daemon=True).start()
            case _:
                raise ValueError(f"no handler for the command {cmd!r}")

    def _grammar_submits(self):
        """The threads that submit requests with a grammar (engine/grammar/grammar_compile.py
        compiles it on its own threads; these wait for it)."""
        if self._grammar_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._grammar_pool = ThreadPoolExecutor(4, thread_name_prefix="submit-grammar")
        return self._grammar_pool

    def _submit_apart(self, cmd: Submit) -> None:
        try:
            self.submit(cmd)
        except Exception as e:  # as the command loop does: a bad request must not end the engine
            log.exception("command Submit failed")
            self.writer.send(Rejected(cmd.id, "internal",
                                      f"the engine could not take the request: {one_line(e)}"))
        finally:
            with self._lock:
                self._compiling.discard(cmd.id)
                self._cancelled_early.discard(cmd.id)

    def _save_profile(self, cmd: SaveExpertProfile) -> None:
        """The engine thread hands over a copy of the counts between windows; the file is written
        here, into the directory the server chose (created 0o700), through a private temporary
        file."""
        try:
            out = self.engine.save_expert_profile(cmd.path, private_dir=True)
        except ValueError as e:                 # a model without experts
            self.writer.send(Rejected(cmd.id, "invalid", str(e), param="name"))
        # the server's directory cannot be written: said without its path
        except OSError as e:
            log.error("the expert profile was not written to %s: %s", cmd.path, e)
            self.writer.send(Rejected(cmd.id, "server", "the expert profile was not written: "
                                      f"{e.strerror or type(e).__name__} (the server's log has the "
                                      "details)"))
        except Exception:
            log.exception("the expert profile was not written")
            self.writer.send(Rejected(cmd.id, "internal", "the expert profile was not written"))
        else:
            self.writer.send(Saved(cmd.id, out["path"], out["routed"]))

    def _slot_action(self, cmd: SlotAction) -> None:
        from strata_jax.engine import slot_files

        try:
            out = self.engine.slot_action(cmd.action, cmd.slot, cmd.path)
        except slot_files.SlotFileError as e:
            self.writer.send(Rejected(cmd.id, "invalid", str(e), param="filename"))
        except OSError as e:
            log.error("slot file %s: %s", cmd.path, e)
            self.writer.send(Rejected(cmd.id, "server", "the slot file could not be "
                                      f"{'written' if cmd.action == 'save' else 'read'}: "
                                      f"{e.strerror or type(e).__name__}"))
        except Exception:
            log.exception("slot action %s failed", cmd.action)
            self.writer.send(Rejected(cmd.id, "internal", "the slot action failed"))
        else:
            self.writer.send(Answer(cmd.id, slot=out))

    def _tokens(self, cmd: Tokenize | Detokenize) -> None:
        from ..tokens import answer

        try:
            self.writer.send(answer(self.engine.tokenizer, cmd))
        except Exception:
            log.exception("%s failed", type(cmd).__name__)
            self.writer.send(Rejected(cmd.id, "internal", f"{type(cmd).__name__} failed"))

    def _embed(self, cmd: Embed) -> None:
        from strata_jax.engine.request import ContextOverflowError, RequestError

        # set by a Cancel: the engine drops the job's next pieces
        cancel = threading.Event()
        with self._lock:
            self.handles[cmd.id] = cancel
        try:
            from ..tokens import tokenize_mixed

            tk = self.engine.tokenizer        # a list of texts and ids: llama.cpp's mixed prompt
            ids = [tokenize_mixed(tk, x, True, True)
                   if isinstance(x, list) and any(isinstance(t, str) for t in x)
                   else self.engine.prompt_ids(x) for x in cmd.inputs]
            vectors = self.engine.embed(ids, cmd.pooling, cmd.normalize, cancel)
        except ContextOverflowError as e:
            self.writer.send(Rejected(cmd.id, "context", str(e), n_prompt_tokens=e.prompt_tokens,
                                      max_tokens=0, n_ctx=e.n_ctx))
        except (RequestError, ValueError) as e:
            self.writer.send(Rejected(cmd.id, "invalid", str(e), param="input"))
        except RuntimeError as e:               # embeddings beside the expert tiers
            self.writer.send(Rejected(cmd.id, "server", str(e)))
        except Exception:
            log.exception("embeddings failed")
            self.writer.send(Rejected(cmd.id, "internal", "the embeddings failed"))
        else:
            self.writer.send(Answer(cmd.id, embeddings=[v.tolist() for v in vectors],
                                    n_tokens=[len(i) for i in ids]))
        finally:
            with self._lock:
                self.handles.pop(cmd.id, None)

    def _stats(self) -> dict[str, Any]:
        # read while the engine thread changes its dicts: a rare "changed size" error
        for _ in range(3):
            try:
                return self.engine.stats()
            except RuntimeError:
                time.sleep(0.01)
        return self.engine.stats()

    def submit(self, cmd: Submit) -> None:
        """A request as the server prepared it, into the engine; a grammar that cannot be compiled
        is refused (Rejected "invalid", naming the request's field), and the server answers 400.
        A Cancel that came while its grammar compiled (`_cancelled_early`) is applied here."""
        from strata_jax.engine.request import RequestError

        try:
            req = self.engine.prepared_request(cmd.ids, cmd.sampling, cmd.progress, cmd.cache_salt,
                                               cmd.checkpoint_at)
        except RequestError as e:
            grammar = cmd.sampling.grammar or ()
            field = grammar[2] if len(grammar) > 2 else None
            self.writer.send(Rejected(cmd.id, "invalid", str(e), param=field))
            return
        h = self.engine.enqueue(req)
        with self._lock:
            self.handles[cmd.id] = h
            cancelled = cmd.id in self._cancelled_early
        if cancelled:
            h.cancel()
        threading.Thread(target=self._forward, args=(cmd.id, h), name=f"req-{cmd.id}",
                         daemon=True).start()

    def _forward(self, rid: str, h) -> None:
        """Each of the request's events as it comes, with its server side filled in here, off the
        engine thread: the tokens' bytes for logprobs (logprobs.py) and their ids (llama.cpp's
        n_probs)."""
        piece = self.engine.tokenizer.token_bytes
        try:
            for ev in h:
                if ev.logprob is not None:
                    alts = ev.top_logprobs or ()
                    ev = dataclasses.replace(ev,
                                             logprobs=[piece(ev.token), ev.logprob,
                                                       [[piece(t), v] for t, v in alts]],
                                             logprob_ids=[ev.token, [t for t, _ in alts]])
                self.writer.send(EventFrame(rid, ev))
        finally:
            with self._lock:
                self.handles.pop(rid, None)


if __name__ == "__main__":
    sys.exit(main())
