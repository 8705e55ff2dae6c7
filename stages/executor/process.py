"""The executor stage process: the model forward (numpy backend here), fed with experts from the RAM
tier's shared-memory slots, serving up to --max-batch GenerateRequests at once (continuous batching: stages/executor/serving.py) with
streaming Tokens.

Sockets: binds `executor` (ROUTER; peer: the supervisor, which brokers clients); connects a DEALER to
`ramtier`."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import zmq

from coli.container.format import MANIFEST_NAME
from coli.container.reader import ContainerReader
from coli.loader import make_backend
from coli.model.forward import GlmMoeDsaModel
from coli.protocol.arena import Arena
from coli.protocol.handshake import run_identity
from coli.protocol.messages import Cancel, DropSession, GenerateRequest, Hello, Shutdown
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket, send
from coli.stages.common import drain_router, greet, send_stats, orphan_cleanup, Ticker, configure_logging, die_with_parent, parent_sentinel
from coli.stages.executor.experts import RamTierExperts
from coli.stages.executor.batch_defaults import DEFAULT_STEP_TOKENS
from coli.stages.executor.scheduler import Scheduler
from coli.stages.executor.serving import BatchServer, StopRequested
from coli.stages.executor.sessions import SessionStore, model_fingerprint
from coli.stages.faults import Faults
from coli.stages.ramtier.core import ResidencyTable

STAGE = "executor"


def executor_main(run_name: str, run_base: str, arena_name: str, table_name: str, container_dir: str,
                  device: str = "cpu", log_level: str = "info", sessions_dir: str | None = None,
                  record_routing: str | None = None, pilot: int = 0, gpu: dict | None = None,
                  control: bytes | None = None, max_batch: int = 1, step_tokens: int = 0, mtp: str = "off",
                  prefill_chunk: int = 0) -> None:
    """`control`: the supervisor's routing identity (a per-run secret handed over at spawn); requests and
    control messages from any other peer are refused. None accepts any peer. `max_batch` sequences run at once
    (stages/executor/scheduler.py); `step_tokens` is a step's token budget (0: DEFAULT_STEP_TOKENS); `mtp` is the
    drafting of a request that does not say (`coli up --mtp`, docs/mtp.md); `prefill_chunk` is a step's token budget
    while the experts stream (0: auto, coli/gpu/prefill_budget.py)."""
    rd = RunDir(run_name, run_base, create=False)
    log = configure_logging(rd.log_path(STAGE), STAGE, log_level)
    die_with_parent()
    t_load = time.perf_counter()
    weights = ContainerReader(container_dir)
    cfg = weights.config
    arena = Arena.attach(arena_name)
    tarena = Arena.attach(table_name)
    table = ResidencyTable(tarena.slot_view(0), cfg.num_hidden_layers * cfg.n_routed_experts, arena.n_slots)

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, rd.endpoint(STAGE), bind=True)
    ram = make_socket(ctx, zmq.DEALER, rd.endpoint("ramtier"), bind=False, identity=run_identity(STAGE, control))
    ps = parent_sentinel()
    early: list[tuple[bytes, GenerateRequest]] = []
    state = {"supervisor": None, "server": None, "stop": False, "backend": None, "vram": None, "gpu_name": None,
             "model": None, "vx": None}

    def handle(peer: bytes, msg) -> None:
        if isinstance(msg, Hello):
            info = {"device": state["backend"].name, "layers": cfg.num_hidden_layers, "max_batch": max_batch,
                    "load_s": round(time.perf_counter() - t_load, 3)}
            if state["vram"]:
                info.update(vram=state["vram"], gpu_name=state["gpu_name"])
            if greet(sock, peer, msg, STAGE, info, log, control=control):
                state["supervisor"] = peer
        elif control is not None and peer != control:
            # clients reach the executor through the supervisor only (its checks and its fairness)
            log.error("protocol_error", peer=repr(peer),
                      error=f"{type(msg).__name__} refused: the executor takes messages only from the supervisor")
        elif isinstance(msg, Cancel):
            state["server"].cancel(msg.request_id)      # it leaves at the next token boundary
        elif isinstance(msg, DropSession):
            if state["server"].session_in_use(msg.session):   # in use: dropped once its turn ends
                state["server"].drop_after.add(msg.session)
            else:
                log.info("session_dropped", session=msg.session, found=sessions.drop(msg.session))
        elif isinstance(msg, Shutdown):
            log.info("shutdown", reason=msg.reason)
            state["stop"] = True
            raise StopRequested()
        elif isinstance(msg, GenerateRequest):
            if state["server"] is None:     # still loading: it joins once the server is there
                early.append((peer, msg))
            else:
                state["server"].submit(peer, msg)
        else:
            log.error("protocol_error", error=f"unexpected {type(msg).__name__}", peer=repr(peer))

    def pump(timeout_ms: int = 0) -> None:
        """Handle control messages (also while a step waits for experts); raises StopRequested to stop."""
        if ps is not None and zmq.select([ps], [], [], 0)[0]:
            log.warning("supervisor is gone; exiting")
            orphan_cleanup(arena_name, table_name)
            state["stop"] = True
            raise StopRequested()
        if not sock.poll(timeout_ms):
            return
        for peer, msg in drain_router(sock, log):
            handle(peer, msg)

    backend = make_backend(device)
    state["backend"] = backend
    experts = RamTierExperts(ram, arena, table, weights.record_layout, cfg.n_routed_experts, arena.n_slots,
                             idle=pump, log=log)
    faults = Faults.from_env()
    vx = None
    step_tokens = step_tokens or DEFAULT_STEP_TOKENS
    # numpy: every step decodes each expert it uses from its RAM-tier record, so the experts always stream; its
    # default chunk stays step_tokens (its step costs arithmetic that grows with the tokens; docs/runtime.md)
    cpu_chunk = prefill_chunk or step_tokens
    chunk, streaming = cpu_chunk, True
    if backend.name == "cuda":
        model, vx, chunk = _gpu_model(cfg, weights, backend, experts, arena, table, gpu or {}, faults, log, state,
                                      prefill_chunk, step_tokens)
        streaming = vx.n_slots < len(cfg.moe_layers) * cfg.n_routed_experts    # not every routed expert resident
    else:
        model = GlmMoeDsaModel(cfg, weights, backend, experts=experts)
    state["model"], state["vx"] = model, vx
    recorder = None
    if record_routing:
        from coli.trace import RoutingRecorder
        recorder = RoutingRecorder.for_model(record_routing, cfg, meta={"source": "coli up", "run": run_name})

    def attach_hooks(m) -> None:
        m.routing_hook = recorder
        if pilot > 0:  # router lookahead: layer l+pilot's predicted experts go to the VRAM/RAM prefetch
            from coli.pilot import Pilot
            sink = state["vx"].prefetch if state["vx"] is not None else experts.prefetch
            m.pilot_hook = Pilot(m, pilot, "shared", sink=lambda t, ids, idx: sink(t, ids))

    attach_hooks(model)

    def demote(err: Exception) -> None:
        """The GPU is gone: continue on the CPU (numpy backend over the RAM tier), with a clear log line."""
        log.error("gpu_lost_demoting_to_cpu", error=str(err),
                  note="the run continues on the CPU; restart it to use the GPU again")
        old = state["vx"]
        state["vx"] = None
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        from coli.model.numpy_backend import NumpyBackend
        nb = NumpyBackend()
        state["backend"] = nb
        m = GlmMoeDsaModel(cfg, weights, nb, experts=experts)
        attach_hooks(m)
        state["model"] = m
        sched.prefill_chunk, sched.streaming = cpu_chunk, True     # the GPU's chunk may not suit numpy's memory
        if sessions.live:     # their caches lived on the GPU; each one's last committed turn stays loadable
            log.warning("sessions_dropped_on_demotion", sessions=list(sessions.live))
            for name in list(sessions.live):
                sessions.forget(name)
        counters["demoted"] = 1

    manifest = (Path(container_dir) / MANIFEST_NAME).read_bytes()
    sessions = SessionStore(cfg, lambda *a, **k: state["model"].new_cache(*a, **k), Path(sessions_dir or Path(container_dir) / "sessions"),
                            model_fingerprint(cfg, manifest), log=log)
    counters = {"requests": 0, "tokens": 0, "cancelled": 0, "failed": 0, "decode_s": 0.0, "prefill_s": 0.0, "step_s": 0.0,
                "last_tokens_per_s": 0.0, "last_latency_s": 0.0, "cpu_fallbacks": 0, "copy_busy": 0.0, "sm_busy": 0.0,
                "demoted": 0}
    ticker = Ticker(0.5)
    t_start = time.time()
    log.info("started", device=backend.name, load_s=round(time.perf_counter() - t_load, 3), slots=arena.n_slots,
             pilot=pilot, vram=state["vram"], max_batch=max_batch, step_tokens=step_tokens, prefill_chunk=chunk,
             experts_stream=streaming)

    def publish_stats() -> None:
        if state["supervisor"] is None:
            return
        vx = state["vx"].snapshot() if state["vx"] is not None else {}
        c = merged_stats(counters, experts.stats, vx, sched.snapshot(), uptime_s=time.time() - t_start)
        send_stats(sock, state["supervisor"], STAGE, c)

    def finish_vram() -> None:
        """Every copy of the request landed and its RAM-tier lease went back; a GPU lost meanwhile demotes."""
        vx = state["vx"]
        if vx is None:
            return
        try:
            vx.finish()
        except Exception as e:
            if _gpu_fatal(e):
                demote(e)
            else:
                log.error("vram_finish_failed", error=str(e))

    def gpu_lost(e: Exception) -> bool:
        """A failed step on the GPU whose context is gone: demote to the CPU (every sequence restarts there)."""
        if state["vx"] is None or not _gpu_fatal(e):
            return False
        demote(e)
        return True

    if recorder is not None and max_batch > 1:
        # a routing trace is one sequence's positions in order: batched rows would interleave sequences
        log.warning("max_batch_one_for_routing_trace", max_batch=max_batch,
                    note="--record-routing serves one sequence per step")
        max_batch = 1
    sched = Scheduler(max_batch, step_tokens, chunk, streaming)
    def answer(peer: bytes, msg) -> None:
        try:
            send(sock, msg, peer=peer)
        except zmq.ZMQError as e:       # the supervisor is gone or its socket full: never the batch's end
            log.error("answer_not_sent", request_id=getattr(msg, "request_id", None), error=str(e))

    server = BatchServer(sched, cfg, sessions, lambda: state["model"], answer, counters, log, faults=faults,
                         recorder=recorder, on_step_error=gpu_lost, after_batch=finish_vram, mtp=mtp)
    state["server"] = server
    for peer, msg in early:
        server.submit(peer, msg)

    try:
        while not state["stop"]:
            try:       # between steps: control messages and newcomers (waiting only when there is nothing to run)
                pump(0 if server.busy else ticker.timeout_ms() + 1)
                if ticker.due():
                    publish_stats()
                server.step()
            except StopRequested:
                server.shutdown()
                break
            except Exception as e:      # a bug in the loop itself: its sequences fail, never the run
                log.exception("step_failed", error=f"{type(e).__name__}: {e}")
                server.fail_all(e)
    finally:
        try:
            saved = sessions.save_all()
            if saved:
                log.info("sessions_saved", count=len(saved), dir=str(sessions.dir))
        except Exception as e:  # never lose the shutdown over it, but say so
            log.error("sessions_not_saved", error=str(e))
        if recorder is not None:
            recorder.close()
        sock.close(linger=0)
        ram.close(linger=0)
        ctx.term()
        # every numpy view over the arenas must be gone before they unmap: the model, its expert source and
        # the residency table hold them, also through `state` and the closures above, and cycles among them
        # wait for the collector
        state["model"] = state["vx"] = state["server"] = None
        del model, experts, table, sessions, server, sched
        gc.collect()
        for a in (tarena, arena):
            try:
                a.close()
            except Exception as e:
                log.warning("arena_close", error=str(e))
        log.info("stopped", **{k: v for k, v in counters.items() if isinstance(v, int)})


def merged_stats(counters: dict, expert_stats: dict, vram: dict, batch: dict, **extra) -> dict:
    """The executor's published stats: its counters, the RAM-tier client's, the VRAM engine's and the batch
    scheduler's, in that order of precedence from low to high. The scheduler's go last: the VRAM engine also counts
    "steps" (its per-MoE-layer stream calls), and `coli stats` reads the batch's steps per token from this key."""
    c = dict(counters)
    c.update(expert_stats)
    c.update(vram)
    c.update(batch)
    c.update(extra)
    return c


def _gpu_fatal(e: Exception) -> bool:
    """Whether an error means the CUDA context is gone (the run must leave the GPU)."""
    from coli.gpu.driver import DriverError
    from coli.gpu.vram_experts import GpuLost
    if isinstance(e, GpuLost) or (isinstance(e, DriverError) and e.fatal):
        return True
    text = str(e).lower()
    return any(w in text for w in ("illegal address", "context is destroyed", "launch failed", "unspecified launch",
                                   "device-side assert", "gpu lost", "cuda_error_unknown"))


def _gpu_model(cfg, weights, backend, experts, arena, table, gpu: dict, faults, log, state, prefill_chunk: int = 0,
               step_tokens: int = DEFAULT_STEP_TOKENS):
    """The model on the CUDA backend with the VRAM expert cache over the RAM tier's arena, the budget reserving the
    prefill chunk's rows (0: auto from the budget). -> (model, source, prefill chunk)."""
    from coli.gpu.prefill_budget import auto_prefill_chunk
    from coli.gpu.setup import build_vram_experts
    from coli.model.forward import GlmMoeDsaModel
    from coli.stages.executor.gpu_host import ArenaHostTier

    class _Unset:
        def stream(self, layer, ids):
            raise RuntimeError("the VRAM expert cache is not set up yet")

    model = GlmMoeDsaModel(cfg, weights, backend, experts=_Unset())
    backend.faults = faults if faults.rates else None
    host = ArenaHostTier(experts, arena, table, cfg.n_routed_experts)
    vram_gb, slots = gpu.get("vram_gb"), gpu.get("vram_slots")
    free, _total = backend.rt.drv.mem_get_info()
    device_gb = (backend.rt.pool.active_bytes + 0.9 * free) / 1e9     # what the device has free, less a margin
    if vram_gb is None and slots is None:       # no budget given
        vram_gb = device_gb
    max_context = int(gpu.get("max_context") or 4096)
    chunk = prefill_chunk or auto_prefill_chunk(cfg, int((vram_gb or device_gb) * 1e9), max_context, step_tokens)
    vx, plan = build_vram_experts(model, host, cfg, weights.record_layout, vram_gb=vram_gb, slots=slots,
                                  max_context=max_context, policy=gpu.get("policy") or "freq",
                                  tile_bytes=int(gpu.get("tile_kb") or 1024) * 1024,
                                  faults=faults if faults.rates else None, log=log, prefill_rows=chunk)
    state["vram"] = plan["line"]
    state["gpu_name"] = backend.rt.name
    log.info("vram_pool", **{k: v for k, v in plan.items() if k != "line"}, line=plan["line"], prefill_chunk=chunk)
    return model, vx, chunk
