"""Serving wrapper: the engine loop runs in its own thread; asyncio callers submit, stream, abort.

Two threads share nothing but a command queue and one callback per step:

* **engine thread** owns the :class:`~laser.frontend.engine.Engine` exclusively. Its loop: run the
  queued commands (add, abort, anything else) -> ``engine.step()`` -> hand the step's
  outputs to the event loop with *one* ``loop.call_soon_threadsafe``. With nothing to run it
  waits on an event (no busy spin) and checks the allocators' integrity once.
* **event-loop thread** (the HTTP server) tokenizes in a helper thread with its own copy of the
  tokenizer, decides admission (bounded queue, TTFT feasibility), queues commands, and reads
  each request's outputs from an ``asyncio.Queue``. Nothing it does waits on a step.

The engine thread's half lives in :mod:`laser.frontend.engine_thread`; the admission decision
in :mod:`laser.frontend.admission`; the input and output paths in :mod:`laser.frontend.inputs`
and :mod:`laser.frontend.outputs`.

Commands run *between* steps, so the engine is never touched from two threads. An abort
issued while a step runs takes effect right after it; the scheduler skips outputs of
requests that are gone.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from .admission import (  # noqa: F401 - the admission errors and decision are part of this module's API
    Admission,
    EngineStepError,
    EngineStoppedError,
    EngineUnavailableError,
    QueueAwareAdmission,
    QueueFullError,
    SLOInfeasibleError,
)
from ..core.owner_thread import OwnerThread
from .engine_thread import EngineThread, EngineThreadTimes
from .outputs import aborted_output
from ..core.request import SLO, InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)

ON_INFEASIBLE = ("queue", "reject", "demote")


def predicted_prefill_seconds(engine, num_prompt_tokens: int) -> float | None:
    """Predicted prefill time (seconds) of a prompt run alone, right now; None without a model.

    The one place admission control asks the latency model; switch here when the engine grows
    a better predictor.
    """
    f = getattr(engine, "predict_prefill_seconds", None)
    if f is not None:
        return f(num_prompt_tokens)
    lm = getattr(engine, "latency_model", None)
    if lm is None:
        return None
    return lm.predict_prefill(num_prompt_tokens)


class RequestStream:
    """One submitted request, seen from the event loop.

    Its outputs (:class:`~laser.frontend.outputs.RequestOutput`) go to ``queue``, which several streams
    may share (``n > 1``, batched prompts); a failure arrives as a :class:`StreamError`.
    """

    __slots__ = ("req_id", "prompt_token_ids", "admission", "queue", "last", "first_token_seen", "done", "added",
                 "added_time")

    def __init__(self, req_id: str, prompt_token_ids: list[int], admission: Admission, queue: asyncio.Queue):
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.admission = admission
        self.queue = queue
        self.last = None  # latest RequestOutput
        self.first_token_seen = False
        self.done = False
        self.added: asyncio.Future | None = None  # resolves when the engine has the request
        self.added_time: float | None = None  # engine clock when the engine took it (its result)


@dataclass
class StreamError:
    """Queue item: the request failed (engine error, shutdown without output)."""

    req_id: str
    error: BaseException


class AsyncEngine(EngineThread):
    """Runs an :class:`~laser.frontend.engine.Engine` in a background thread for an asyncio server.

    Args:
        engine: the engine; from :meth:`start` on only the engine thread touches it.
        max_waiting: accepted requests that have not produced a first token, at most; more
            get :class:`QueueFullError` (the bounded queue).
        on_infeasible: when the predicted TTFT misses the target: ``queue`` (serve anyway),
            ``reject`` (:class:`SLOInfeasibleError`) or ``demote`` (serve as the strictest looser
            class it is predicted to meet, else ``best_effort``:
            :meth:`QueueAwareAdmission.decide`). Otherwise a demotable hot request is served as
            its warm class when the TTFT predicted behind the waiting hot and warm prompts
            misses its target (issue 14).
        idle_wait_s: longest idle sleep of the engine thread (it wakes at once on a command).
        check_integrity_when_idle: run ``engine.check_integrity(expect_empty=True)`` whenever
            the engine goes idle (errors are logged).
        owner: the :class:`OwnerThread` that built ``engine``; it steps the engine (one thread for
            all of the engine's torch work: a second thread's OpenMP team slowed 2-thread steps
            4x). None: a new thread.
    """

    def __init__(
        self,
        engine,
        max_waiting: int = 256,
        on_infeasible: str = "queue",
        idle_wait_s: float = 1.0,
        check_integrity_when_idle: bool = True,
        owner: OwnerThread | None = None,
    ):
        if on_infeasible not in ON_INFEASIBLE:
            raise ValueError(f"on_infeasible must be one of {ON_INFEASIBLE}, got {on_infeasible!r}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_infeasible = on_infeasible
        self.idle_wait_s = idle_wait_s
        self.check_integrity_when_idle = check_integrity_when_idle
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.slo_classes = engine.slo_classes
        self.inputs = engine.inputs.copy()  # the input path on the tokenizer thread's own tokenizer
        # -- shared between threads (deque append/popleft are atomic) --
        self._cmds: collections.deque = collections.deque()  # run between steps
        self._adds: collections.deque = collections.deque()  # arrivals: also at layer boundaries
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = owner  # the thread that built the engine steps it (OwnerThread)
        self._stop_requested = False
        self.dead: BaseException | None = None  # set when the engine can no longer serve
        self.num_steps = 0
        self.times = EngineThreadTimes()  # the engine thread's time split (its writer)
        self.num_step_errors = 0
        self._num_adds_run = 0  # engine thread: add commands taken (in submission order)
        # Snapshot published by the engine thread + requests admitted since (event loop).
        self.queue_admission = QueueAwareAdmission(getattr(engine, "latency_model", None))
        self._num_submitted = 0
        # -- event-loop side only --
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="laser-tokenizer")
        # /tokenize (text of any length, as vLLM's): its own thread, so that a megabyte of text (~1 s a MB)
        # does not hold every request's prompt behind it.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="laser-tokenize-route")
        self.num_queued = 0  # accepted, no first token yet (bounded by max_waiting)
        self.draining = False
        self.listeners: list[Callable[[RequestStream, Any], None]] = []  # (stream, output) on each output

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread, delivering outputs to ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        if self._owner is not None:
            self._thread = self._owner.run(self._run)
        else:
            self._thread = threading.Thread(target=self._run, name="laser-engine", daemon=True)
            self._thread.start()

    def begin_drain(self) -> None:
        """Refuse new requests (:class:`EngineStoppedError`); in-flight ones keep going."""
        self.draining = True

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout`` seconds,
        abort the rest (their streams end with ``finish_reason="abort"``), stop the thread."""
        self.begin_drain()
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self._streams and time.monotonic() < deadline and self.running:
            await asyncio.sleep(0.05)
        self._stop_requested = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        # Outputs posted by the thread's last act run now; anything left gets its abort.
        await asyncio.sleep(0)
        for s in list(self._streams.values()):
            self._finish_aborted(s)
        self._shutdown_tokenizers()

    def stop(self, timeout: float = 30.0) -> None:
        """Synchronous stop (no draining) for use outside the event loop."""
        self.draining = True
        self._stop_requested = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._shutdown_tokenizers()

    def _shutdown_tokenizers(self) -> None:
        """Stop the prompts' tokenizer thread and ``/tokenize``'s (not waiting for a call in progress)."""
        self._tok_pool.shutdown(wait=False)
        self._tokenize_pool.shutdown(wait=False)

    # -- commands -----------------------------------------------------------------------------------
    def _submit(self, fn: Callable, arrival: bool = False) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        (self._adds if arrival else self._cmds).append((fn, fut))
        self._wake.set()
        return fut

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        if not self.running:
            raise EngineStoppedError("engine is not running")
        return await asyncio.wrap_future(self._submit(fn))

    async def check_integrity(self, expect_empty: bool = False) -> None:
        """``engine.check_integrity`` on the engine thread (raises AssertionError on corruption)."""
        await self.run_in_engine(lambda e: e.check_integrity(expect_empty=expect_empty))

    def abort(self, req_id: str) -> None:
        """Abort a request (idempotent): its KV and paused state are freed after the current step."""
        s = self._streams.pop(req_id, None)
        if s is not None:
            self._mark_done(s)
        if self.running:
            self._submit(lambda e: e.abort(req_id))

    def abort_all(self) -> None:
        """Abort every request now (their streams end with ``finish_reason="abort"``)."""
        if self.running:
            self._submit(lambda e: self._abort_requests())

    # -- requests -----------------------------------------------------------------------------------
    async def encode(self, prompt: str | list[int] | list[dict], tools: list[dict] | None = None,
                     keep: int | None = None, **switches) -> list[int]:
        """Token ids of a prompt (text, ids, or chat messages, with ``tools``: OpenAI tool
        definitions, ``keep``: the tokens the caller keeps, and the chat template ``switches`` of
        :meth:`~laser.frontend.inputs.InputProcessor.encode_prompt`). Raises InvalidRequestError."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool,
                                          lambda: self.inputs.encode_prompt(prompt, tools, keep, **switches))

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain ``text`` as the tokenizer makes them (vLLM's ``/tokenize``; with
        ``add_special_tokens`` True it is the prompt encoding). Any length, as vLLM's, tokenized on
        a thread of its own, not on the one every request's prompt waits for: a 1.3 MB text (under
        the length that prompts are refused at) held a chat request for 0.56 s there. Raises
        InvalidRequestError for text that is not valid Unicode."""
        from .inputs import check_text

        check_text(text, "prompt")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool, functools.partial(self.inputs.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def resolve_bad_words(self, sp: SamplingParams) -> SamplingParams:
        """``sp`` with its ``bad_words`` tokenized (:meth:`~laser.frontend.inputs.InputProcessor.bad_words_ids`)
        on the tokenizer thread, so that a bad word is refused before admission and the engine thread
        never tokenizes (it only fills ``bad_words_token_ids`` when they are still None). ``sp`` itself
        without bad words or with their ids already set. Raises InvalidRequestError (a bad word)."""
        if not sp.bad_words or sp.bad_words_token_ids is not None:
            return sp
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tok_pool, self.inputs.bad_words_ids, sp.bad_words)
        return dataclasses.replace(sp, bad_words_token_ids=ids)

    async def decode(self, ids: list[int]) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool, self.inputs.tokenizer.decode, ids)

    def predict_ttft(self, num_prompt_tokens: int) -> float | None:
        return predicted_prefill_seconds(self.engine, num_prompt_tokens)

    def cached_prompt_tokens(self, ids: list[int]) -> int:
        """Tokens of prompt ``ids`` the engine's prefix cache holds now, as the scheduler will
        find them (whole blocks, the last token always computed); 0 without a local cache (a
        cluster front end: its controller routes by the instances' summaries). Read off the
        engine thread -- single dict reads of the block manager's hash map: an estimate for
        admission, exact unless a block is published or evicted meanwhile."""
        kv = getattr(self.engine, "kv_cache", None)
        if kv is None or not kv.block_manager.enable_prefix_caching or len(ids) < 2:
            return 0
        bm = kv.block_manager
        return bm.cached_prefix_blocks(bm.block_hashes([], ids), len(ids) - 1) * bm.block_size

    def admit(self, prompt_lens: list[int], slo: SLO, arrival: float | None = None,
              cached: list[int] | None = None) -> list[Admission]:
        """Admission control for requests about to be added (one per prompt length; ``cached``:
        the tokens of each prompt the prefix cache holds, :meth:`cached_prompt_tokens`, priced as
        computed already).

        The predicted TTFT (:func:`laser.scheduler.ttft.predict_ttft`) counts, from ``arrival``
        (engine clock; default now), the rest of the running step and the prefill of every
        request ahead in the queue order — from the report the engine thread published
        after its last step plus the requests admitted since — so it needs no engine step.

        Raises EngineStoppedError (draining/dead), QueueFullError (bounded queue full),
        SLOInfeasibleError (``on_infeasible == "reject"``) or InvalidRequestError (more prompts
        at once than the queue bound: waiting could never admit them). Call :meth:`submit` for each in the
        same event-loop turn (no ``await`` in between), or the queue bound may be overrun.
        """
        if self.draining or self.dead is not None or self._stop_requested:
            raise EngineStoppedError(
                "server is shutting down" if self.dead is None else f"engine failed: {self.dead}"
            )
        if len(prompt_lens) > self.max_waiting:  # not a full queue: a 429 "retry later" would be retried in vain
            raise InvalidRequestError(f"prompt: {len(prompt_lens)} choices (prompts x n) in one request; this server "
                                      f"queues at most {self.max_waiting} requests at once (--max-waiting): send "
                                      "fewer per request")
        if self.num_queued + len(prompt_lens) > self.max_waiting:
            raise QueueFullError(
                f"too many waiting requests ({self.num_queued} waiting, limit {self.max_waiting}); retry later"
            )
        qa = self.queue_admission
        now = self.engine.clock()
        arrival = now if arrival is None else arrival
        view = qa.view(now)
        out = []
        for i, n in enumerate(prompt_lens):
            adm, view = qa.decide(n, slo, arrival, now, view, self.on_infeasible, self.slo_classes,
                                  cached[i] if cached else 0)
            out.append(adm)
        return out

    def queued_interactive_tokens(self) -> int:
        """Prompt tokens of accepted hot and warm requests without a first token (event loop)."""
        return sum(len(s.prompt_token_ids) for s in self._streams.values()
                   if not s.first_token_seen and s.admission.slo.tier in ("hot", "warm"))

    def queued_of_tier(self, tier: str) -> int:
        """Accepted requests of SLO tier ``tier`` without a first token (event loop)."""
        return sum(1 for s in self._streams.values() if not s.first_token_seen and s.admission.slo.tier == tier)

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        admission: Admission,
        queue: asyncio.Queue | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue an admitted request for the engine without waiting; ``stream.added`` resolves
        once the engine has it (or raises InvalidRequestError / EngineStoppedError).

        Its outputs go to ``queue`` (a new one if None). The engine sees it at its next layer
        boundary, so a layer-level policy may react mid-step. ``arrival_time`` (engine clock;
        default: now) is when the client's request arrived: tokenization and queueing count
        toward its TTFT. Synchronous, so :meth:`admit` + ``submit`` in one event-loop turn keep
        the waiting queue bounded exactly.
        """
        if not self.running or self._stop_requested:
            raise EngineStoppedError("engine is not running")
        req_id = req_id or f"req-{uuid.uuid4().hex}"
        arrival = self.engine.clock() if arrival_time is None else arrival_time
        stream = RequestStream(req_id, prompt_token_ids, admission, queue or asyncio.Queue())
        self._streams[req_id] = stream
        self.num_queued += 1
        self._num_submitted += 1  # the engine thread counts adds in this same order
        if admission.entry is not None:
            self.queue_admission.admitted(self._num_submitted, admission.entry)
        def add(e) -> float:  # engine thread: the request in, and when (engine clock)
            e.add_request(prompt_token_ids, sampling_params, admission.slo, req_id=req_id, arrival_time=arrival)
            return e.clock()

        fut = self._submit(add, arrival=True)
        stream.added = asyncio.wrap_future(fut)
        stream.added.add_done_callback(lambda f, s=stream: self._on_added(s, f))
        return stream

    def _on_added(self, s: RequestStream, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            if self._streams.get(s.req_id) is s:
                del self._streams[s.req_id]
            self._mark_done(s)
        else:
            s.added_time = fut.result()

    async def add_request(self, *args, **kwargs) -> RequestStream:
        """:meth:`submit`, then wait until the engine has the request. If the caller is
        cancelled meanwhile the request is aborted."""
        stream = self.submit(*args, **kwargs)
        try:
            await asyncio.shield(stream.added)
        except asyncio.CancelledError:
            self.abort(stream.req_id)  # queued after the add: frees whatever the add allocated
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int] | list[dict],
        sampling_params: SamplingParams | None = None,
        slo: SLO | str | None = None,
    ) -> AsyncIterator:
        """Encode, admit, add, and yield the request's outputs; aborts it if the caller stops early."""
        sp = sampling_params or SamplingParams()
        ids = self.inputs.fit(await self.encode(prompt, keep=sp.truncate_prompt_tokens), sp.truncate_prompt_tokens)
        sp = await self.resolve_bad_words(sp)
        slo_obj = self.inputs.resolve_slo(slo)
        (adm,) = self.admit([len(ids)], slo_obj, cached=[self.cached_prompt_tokens(ids)])
        stream = await self.add_request(ids, sp, adm)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, StreamError):
                    raise item.error
                yield item
                if item.finished:
                    return
        finally:
            if not stream.done:
                self.abort(stream.req_id)

    # -- event-loop side of delivery -------------------------------------------------------------------
    def _mark_done(self, s: RequestStream) -> None:
        if not s.done:
            s.done = True
            if not s.first_token_seen:
                self.num_queued -= 1

    def _on_outputs(self, outs: list) -> None:
        for out in outs:
            s = self._streams.get(out.req_id)
            if s is None:  # aborted by the client in the meantime
                continue
            if not s.first_token_seen:
                s.first_token_seen = True
                self.num_queued -= 1
            s.last = out
            if out.finished or getattr(out, "handed_off", False):
                del self._streams[out.req_id]
                s.done = True
            for fn in self.listeners:
                try:
                    fn(s, out)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    log.exception("output listener failed")
            s.queue.put_nowait(out)

    def _finish_aborted(self, s: RequestStream) -> None:
        """End a stream whose request the engine aborted (shutdown): a final ``abort`` output."""
        self._streams.pop(s.req_id, None)
        self._mark_done(s)
        out = aborted_output(s.req_id, s.prompt_token_ids, s.admission.slo, s.last)
        for fn in self.listeners:
            try:
                fn(s, out)
            except Exception:  # noqa: BLE001
                log.exception("output listener failed")
        s.queue.put_nowait(out)

    def _on_aborted(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            s = self._streams.get(rid)
            if s is not None:
                self._finish_aborted(s)

    def _on_failed(self, req_ids: list[str], error: BaseException) -> None:
        for rid in req_ids:
            s = self._streams.pop(rid, None)
            if s is not None:
                self._mark_done(s)
                s.queue.put_nowait(StreamError(rid, error))

    def _post(self, fn: Callable, *args) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    # -- statistics (read from the event loop; approximate, never blocks the engine) -----------------------
    def class_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) request counts per SLO class, as of the last published report."""
        c = self.counters()
        return dict(c.get("running", {})), dict(c.get("waiting", {}))

    def counters(self) -> dict:
        """The scheduler's observability counters as of the last step (see
        :meth:`laser.scheduler.base.Scheduler.report`); empty before the first step."""
        rep = self.queue_admission.report
        return rep.counters if rep is not None else {}

    def kv_cache_usage(self) -> float:
        try:
            return float(self.engine.kv_cache.block_manager.usage())
        except Exception:  # noqa: BLE001 - racy read during a mutation
            return float("nan")
