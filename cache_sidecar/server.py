"""gRPC front of the weight cache: `weightcache.v1.WeightCache`, `grpc.health.v1` and reflection.

Health: "" and "weightcache.v1.WeightCache" are SERVING only while every configured revision is
READY; "weightcache.v1.WeightCache/<repo>@<revision>" per configured revision; "liveness" while
the process is up and not draining. SIGTERM: health NOT_SERVING, fetches cancelled, stop(grace).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_sidecar.cache import WeightCache
from cache_sidecar.errors import (
    BranchNotAllowed,
    Cancelled,
    ErrorCode,
    InvalidReference,
    SidecarError,
)
from cache_sidecar.progress import RevisionProgress, RevisionView, State
from cache_sidecar.refs import ModelRef
from inference_svc.server.tracing import Tracing, TracingConfig
from protos.weightcache.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = cache_pb2.DESCRIPTOR.services_by_name["WeightCache"].full_name
TERMINAL = (State.READY, State.FAILED, State.EVICTED)
PROGRESS_INTERVAL_S = 0.1  # at most this often while bytes move; state changes go out at once


def health_name(ref: ModelRef) -> str:
    return f"{SERVICE}/{ref}"


class Jobs:
    """One ensure job and one progress object per revision key (`repo@revision`) in this process."""

    def __init__(self, cache: WeightCache, retry_max_s: float = 30.0) -> None:
        self.cache = cache
        self.retry_max_s = retry_max_s
        self._progress: dict[str, RevisionProgress] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._cancel = threading.Event()
        self._lock = threading.RLock()
        self.listeners: list[Callable[[RevisionView], None]] = []

    def progress(self, ref: ModelRef) -> RevisionProgress:
        key = str(ref)
        with self._lock:
            p = self._progress.get(key)
            if p is None:
                p = RevisionProgress(ref.repo, ref.revision, state=State.STATE_UNSPECIFIED)
                p.on_change = self._notify
                self._progress[key] = p
        self._refresh(ref, p)
        return p

    def _refresh(self, ref: ModelRef, p: RevisionProgress) -> None:
        """Align a progress object with the volume (published by another process, or evicted)."""
        if str(ref) in self._threads and self._threads[str(ref)].is_alive():
            return
        commit = p.view().commit or (ref.revision if ref.pinned else "")
        if not commit:
            return
        pub = self.cache.published(ref.repo, commit)
        state = p.view().state
        if pub is not None and state != State.READY:
            p.update(
                state=State.READY,
                commit=commit,
                local_path=str(pub.path),
                manifest_digest=pub.manifest_digest,
                error_code=ErrorCode.ERROR_CODE_UNSPECIFIED,
                error_message="",
            )
        elif pub is None and state == State.READY:
            p.update(state=State.EVICTED, local_path="", manifest_digest="")

    def ensure(self, ref: ModelRef, forever: bool = False) -> RevisionProgress:
        """Start fetching unless already READY or running; `forever` retries until it works."""
        p = self.progress(ref)
        key = str(ref)
        with self._lock:
            running = key in self._threads and self._threads[key].is_alive()
            if running or p.view().state == State.READY:
                return p
            t = threading.Thread(
                target=self._run, args=(ref, p, forever), daemon=True, name=f"ensure {key}"
            )
            self._threads[key] = t
        # Outside the lock: listeners called by update() come back into this object.
        p.update(state=State.PENDING, error_code=ErrorCode.ERROR_CODE_UNSPECIFIED, error_message="")
        t.start()
        return p

    def _run(self, ref: ModelRef, p: RevisionProgress, forever: bool) -> None:
        delay = self.cache.cfg.retry_backoff_s
        while not self._cancel.is_set():
            try:
                self.cache.ensure(ref, p, self._cancel)
                return
            except Cancelled:
                return
            except SidecarError as err:
                if not (forever and err.retryable):
                    return  # FAILED with the error, already on the progress object
                p.fail(err, retrying=True)
                p.update(error_message=f"{err.message}; retrying in {delay:.1f}s")
                if self._cancel.wait(delay):
                    return
                delay = min(self.retry_max_s, delay * 2)
            except Exception as exc:  # a bug: report it rather than leave the revision hanging
                log.exception("ensure %s failed", ref)
                p.fail(SidecarError(f"internal error: {type(exc).__name__}: {exc}"))
                return

    def _notify(self, view: RevisionView) -> None:
        for fn in list(self.listeners):
            fn(view)

    def cancel_all(self, timeout_s: float = 5.0) -> None:
        self._cancel.set()
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads.values()):
            t.join(max(0.0, deadline - time.monotonic()))


def to_proto(view: RevisionView, cache: WeightCache) -> cache_pb2.RevisionStatus:
    msg = cache_pb2.RevisionStatus(
        repo=view.repo,
        revision=view.revision,
        commit=view.commit,
        state=State(view.state).name,
        bytes_done=view.bytes_done,
        bytes_total=view.bytes_total,
        files_done=view.files_done,
        files_total=len(view.files),
        local_path=view.local_path,
        manifest_digest=view.manifest_digest,
        error_code=ErrorCode(view.error_code).name,
        error_message=view.error_message,
        files=[
            cache_pb2.FileProgress(
                path=f.path, size=f.size, bytes_done=f.bytes_done, sha256=f.sha256, done=f.done
            )
            for f in view.files
        ],
    )
    if view.commit:
        state = cache.state(view.repo, view.commit)
        msg.pinned = state.pinned
        msg.leases = len(state.leases)
        msg.last_used_unix = state.last_used
        pub = cache.published(view.repo, view.commit)
        if pub is not None:
            msg.size_bytes = pub.manifest.total_bytes
            if not view.files:
                msg.bytes_done = msg.bytes_total = pub.manifest.total_bytes
                msg.files_done = msg.files_total = len(pub.manifest.files)
    return msg


class WeightCacheServicer(cache_pb2_grpc.WeightCacheServicer):
    def __init__(self, jobs: Jobs, stopping: threading.Event) -> None:
        self.jobs = jobs
        self.cache = jobs.cache
        self.stopping = stopping

    def _ref(self, model: cache_pb2.ModelRef, context: grpc.ServicerContext) -> ModelRef:
        try:
            ref = ModelRef(model.repo, model.revision, model.allow_branch)
        except InvalidReference as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, err.message)
        if not ref.pinned and not ref.allow_branch:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{ref}: {ref.revision!r} is not a 40-hex commit; pin a commit or set allow_branch",
            )
        return ref

    def _stream(
        self, p: RevisionProgress, context: grpc.ServicerContext, until_terminal: bool
    ) -> Iterator[cache_pb2.RevisionStatus]:
        version, last_state, last_sent = -1, None, 0.0
        while context.is_active() and not self.stopping.is_set():
            view = p.wait_change(version, timeout_s=1.0)
            if view.version == version:
                continue
            now = time.monotonic()
            if view.state == last_state and now - last_sent < PROGRESS_INTERVAL_S:
                time.sleep(PROGRESS_INTERVAL_S - (now - last_sent))
                view = p.view()
            version, last_state, last_sent = view.version, view.state, time.monotonic()
            yield to_proto(view, self.cache)
            if until_terminal and view.state in TERMINAL:
                return

    def Ensure(
        self, request: cache_pb2.EnsureRequest, context: grpc.ServicerContext
    ) -> Iterator[cache_pb2.RevisionStatus]:
        ref = self._ref(request.model, context)
        p = self.jobs.ensure(ref)
        yield from self._stream(p, context, until_terminal=True)

    def Watch(
        self, request: cache_pb2.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[cache_pb2.RevisionStatus]:
        ref = self._ref(request.model, context)
        yield from self._stream(self.jobs.progress(ref), context, until_terminal=False)

    def Status(
        self, request: cache_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> cache_pb2.RevisionStatus:
        ref = self._ref(request.model, context)
        return to_proto(self.jobs.progress(ref).view(), self.cache)

    def List(
        self, request: cache_pb2.ListRequest, context: grpc.ServicerContext
    ) -> cache_pb2.ListResponse:
        out = cache_pb2.ListResponse(
            used_bytes=self.cache.store.used_bytes(), budget_bytes=self.cache.cfg.budget_bytes or 0
        )
        for info in self.cache.revisions():
            out.revisions.append(
                cache_pb2.RevisionStatus(
                    repo=info.repo,
                    revision=info.commit,
                    commit=info.commit,
                    state=State.READY.name,
                    local_path=str(info.path),
                    manifest_digest=info.manifest_digest,
                    pinned=info.pinned,
                    leases=len(info.leases),
                    size_bytes=info.size_bytes,
                    bytes_done=info.size_bytes,
                    bytes_total=info.size_bytes,
                    last_used_unix=info.last_used,
                )
            )
        return out

    def _pin(
        self, request: cache_pb2.PinRequest, context: grpc.ServicerContext, pinned: bool
    ) -> cache_pb2.RevisionStatus:
        ref = self._ref(request.model, context)
        try:
            commit = self.cache.resolve(ref)
        except SidecarError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, err.message)
        self.cache.set_pin(ref.repo, commit, pinned, request.lease_holder)
        p = self.jobs.progress(ref)
        if not p.view().commit:
            p.update(commit=commit)
        return to_proto(p.view(), self.cache)

    def Pin(
        self, request: cache_pb2.PinRequest, context: grpc.ServicerContext
    ) -> cache_pb2.RevisionStatus:
        return self._pin(request, context, True)

    def Unpin(
        self, request: cache_pb2.PinRequest, context: grpc.ServicerContext
    ) -> cache_pb2.RevisionStatus:
        return self._pin(request, context, False)

    def Evict(
        self, request: cache_pb2.EvictRequest, context: grpc.ServicerContext
    ) -> cache_pb2.EvictResponse:
        ref = self._ref(request.model, context)
        try:
            commit = self.cache.resolve(ref)
        except SidecarError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, err.message)
        result = self.cache.evict(ref.repo, commit, force=request.force)
        self.jobs.progress(ref)  # refresh: READY -> EVICTED
        return cache_pb2.EvictResponse(
            evicted=result.evicted, freed_bytes=result.freed_bytes, message=result.message
        )


class SidecarServer:
    """The gRPC server, its health states and the jobs keeping configured revisions READY."""

    def __init__(
        self,
        cache: WeightCache,
        models: list[ModelRef],
        max_workers: int = 32,
        tracing: Tracing | None = None,  # default: from OTEL_TRACES_EXPORTER / OTEL_SERVICE_NAME
    ) -> None:
        self.cache = cache
        self.tracing = tracing or Tracing.from_config(TracingConfig.from_env("cache-sidecar"))
        self.models = models
        self.jobs = Jobs(cache)
        self.stopping = threading.Event()
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grpc"),
            interceptors=self.tracing.interceptors(),
        )
        cache_pb2_grpc.add_WeightCacheServicer_to_server(
            WeightCacheServicer(self.jobs, self.stopping), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        self.port = 0
        self._ready_lock = threading.RLock()  # re-entered: a refresh may notify
        self._states: dict[str, State] = {}

    def start(self, address: str) -> int:
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise SidecarError(f"cannot listen on {address}")
        self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        self.jobs.listeners.append(self._on_change)
        self._update_health()
        self.server.start()
        for ref in self.models:
            self.jobs.ensure(ref, forever=True)
        self._update_health()
        return self.port

    def _on_change(self, view: RevisionView) -> None:
        key = f"{view.repo}@{view.revision}"
        if self._states.get(key) != view.state:  # bytes moving do not change health
            self._states[key] = view.state
            self._update_health()

    def _update_health(self) -> None:
        if self.stopping.is_set():
            return
        with self._ready_lock:
            all_ready = True
            for ref in self.models:
                ready = self.jobs.progress(ref).view().state == State.READY
                all_ready &= ready
                self.health.set(health_name(ref), _serving(ready))
            self.health.set("", _serving(all_ready))
            self.health.set(SERVICE, _serving(all_ready))

    def stop(self, grace_s: float) -> None:
        self.stopping.set()
        self.health.enter_graceful_shutdown()
        self.jobs.cancel_all(timeout_s=grace_s)
        self.server.stop(grace_s).wait()
        self.tracing.shutdown()


def _serving(ok: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def run_server(args: argparse.Namespace, cache: WeightCache) -> int:
    models = [ModelRef.parse(m, allow_branch=args.allow_branch) for m in args.model]
    for ref in models:
        if not ref.pinned and not ref.allow_branch:
            raise BranchNotAllowed(
                f"--model {ref}: {ref.revision!r} is not a 40-hex commit; pin one or pass --allow-branch"
            )
    server = SidecarServer(cache, models)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    port = server.start(f"{args.host}:{args.port}")
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    log.info(
        "serving %s on port %d for %s", SERVICE, port, ", ".join(map(str, models)) or "no models"
    )
    stop.wait()
    log.info("shutting down (grace %.1fs)", args.grace)
    server.stop(args.grace)
    return 0
