"""The executor stage process: the model forward (numpy backend here), fed with experts from the RAM
tier's shared-memory slots, serving one GenerateRequest at a time with streaming Tokens.

Sockets: binds `executor` (ROUTER; peer: the supervisor, which brokers clients); connects a DEALER to
`ramtier`."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import zmq

from coli.container.format import MANIFEST_NAME
from coli.container.reader import ContainerReader
from coli.errors import ColiError, WeightError
from coli.generate import ContextTooLong, Generation
from coli.loader import make_backend
from coli.model.forward import GlmMoeDsaModel
from coli.model.sampling import SamplingParams
from coli.protocol.arena import Arena
from coli.protocol.handshake import run_identity
from coli.protocol.messages import (ERROR_BAD_REQUEST, ERROR_INTERNAL, Cancel, Done, DropSession, Error,
                                    GenerateRequest, Hello, Shutdown, Token)
from coli.protocol.rundir import RunDir
from coli.protocol.sockets import make_socket, send
from coli.stages.common import drain_router, greet, send_stats, orphan_cleanup, Ticker, configure_logging, die_with_parent, parent_sentinel
from coli.stages.executor.experts import ExpertUnavailable, RamTierExperts
from coli.stages.executor.sessions import SessionError, SessionStore, model_fingerprint
from coli.stages.faults import Faults
from coli.stages.ramtier.core import ResidencyTable

STAGE = "executor"


class Cancelled(Exception):
    pass


class StopRequested(Exception):
    pass


def executor_main(run_name: str, run_base: str, arena_name: str, table_name: str, container_dir: str,
                  device: str = "cpu", log_level: str = "info", sessions_dir: str | None = None,
                  record_routing: str | None = None, pilot: int = 0, gpu: dict | None = None,
                  control: bytes | None = None, mtp: str = "off") -> None:
    """`control`: the supervisor's routing identity (a per-run secret handed over at spawn); requests and
    control messages from any other peer are refused. None accepts any peer."""
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
    state = {"supervisor": None, "current": None, "stop": False, "backend": None, "vram": None, "gpu_name": None,
             "model": None, "vx": None}
    inbox: list[tuple[bytes, object]] = []

    def handle(peer: bytes, msg) -> None:
        if isinstance(msg, Hello):
            info = {"device": state["backend"].name, "layers": cfg.num_hidden_layers,
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
            if state["current"] == msg.request_id:
                raise Cancelled()
        elif isinstance(msg, DropSession):
            if state.get("session") == msg.session:   # in use: dropped once its request ends
                state.setdefault("drop_after", set()).add(msg.session)
            else:
                state.get("mtp_carry", {}).pop(msg.session, None)
                log.info("session_dropped", session=msg.session, found=sessions.drop(msg.session))
        elif isinstance(msg, Shutdown):
            log.info("shutdown", reason=msg.reason)
            state["stop"] = True
            raise StopRequested()
        elif isinstance(msg, GenerateRequest):
            inbox.append((peer, msg))
        else:
            log.error("protocol_error", error=f"unexpected {type(msg).__name__}", peer=repr(peer))

    def pump(timeout_ms: int = 0) -> None:
        """Handle control messages; raises Cancelled / StopRequested for the generation in progress."""
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
    if backend.name == "cuda":
        model, vx = _gpu_model(cfg, weights, backend, experts, arena, table, gpu or {}, faults, log, state)
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

    def mtp_head():
        """The current model's MTP draft head (coli.model.mtp), built on first use and again after a demotion. Its
        experts are read from the container directly (or held on the GPU), not through the RAM tier."""
        from coli.model.mtp import load_mtp_head
        if state.get("mtp_head") is None or state["mtp_head"].model is not state["model"]:
            state["mtp_head"] = load_mtp_head(state["model"])
        return state["mtp_head"]

    if mtp != "off":   # the run's default: a container without the layer fails the start, naming --mtp
        mtp_head()

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
        if sessions.live:     # their caches lived on the GPU; each one's last committed turn stays loadable
            log.warning("sessions_dropped_on_demotion", sessions=list(sessions.live))
            for name in list(sessions.live):
                sessions.forget(name)
        counters["demoted"] = 1

    manifest = (Path(container_dir) / MANIFEST_NAME).read_bytes()
    sessions = SessionStore(cfg, lambda *a, **k: state["model"].new_cache(*a, **k), Path(sessions_dir or Path(container_dir) / "sessions"),
                            model_fingerprint(cfg, manifest), log=log)
    counters = {"requests": 0, "tokens": 0, "cancelled": 0, "failed": 0, "decode_s": 0.0, "prefill_s": 0.0,
                "last_tokens_per_s": 0.0, "last_latency_s": 0.0, "cpu_fallbacks": 0, "copy_busy": 0.0, "sm_busy": 0.0,
                "demoted": 0}
    ticker = Ticker(0.5)
    t_start = time.time()
    log.info("started", device=backend.name, load_s=round(time.perf_counter() - t_load, 3), slots=arena.n_slots,
             pilot=pilot, vram=state["vram"])

    def publish_stats() -> None:
        if state["supervisor"] is None:
            return
        c = dict(counters)
        c.update(experts.stats, uptime_s=time.time() - t_start)
        if state["vx"] is not None:
            c.update(state["vx"].snapshot())
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

    def commit_session(sess, rid: str) -> str | None:
        """Persist the session after a turn; the reason it could not be, or None."""
        try:
            sessions.commit(sess)
            return None
        except SessionError as e:
            counters["failed"] += 1
            log.error("session_not_saved", request_id=rid, session=sess.name, error=str(e))
            return str(e)

    def serve(peer: bytes, req: GenerateRequest) -> None:
        rid = req.request_id
        bad = [t for t in req.prompt_ids if t >= cfg.vocab_size]
        if bad:
            send(sock, Error(ERROR_BAD_REQUEST, f"prompt token id {bad[0]} is outside the vocabulary "
                                                f"(0..{cfg.vocab_size - 1})", rid), peer=peer)
            return
        params = SamplingParams(greedy=req.greedy or req.temperature == 0.0, temperature=req.temperature or 1.0,
                                top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        sess, new_ids, cache = None, list(req.prompt_ids), None
        if req.session is not None:
            try:
                sess = sessions.get(req.session, create=req.new_session, ephemeral=req.ephemeral)
            except (SessionError, WeightError, ValueError) as e:
                send(sock, Error(ERROR_BAD_REQUEST, str(e), rid), peer=peer)
                return
            new_ids = sess.reuse(list(req.prompt_ids))
            cache = sess.cache
        reused = len(req.prompt_ids) - len(new_ids)
        spec = None       # MTP drafts: the request's choice, else the run's --mtp
        mode = req.mtp if req.mtp is not None else mtp
        carries = state.setdefault("mtp_carry", {})    # session -> MtpCarry of its last speculative turn
        if mode != "off":
            # a session's later turn continues from its last turn's carry; without one it decodes without drafts
            from coli.model.mtp import parse_mtp
            try:
                spec = (mtp_head(), parse_mtp(mode), carries.pop(req.session, None))   # back only if it ends well
            except ColiError as e:
                send(sock, Error(ERROR_BAD_REQUEST, str(e), rid), peer=peer)
                return
        if recorder is not None:
            recorder.new_sequence()
        state["current"] = rid
        counters["requests"] += 1
        t0 = time.perf_counter()
        n = 0
        out_tokens: list[int] = []
        reason = "length"
        attempt = 0
        base, prompt = 0, new_ids       # a retry after demotion continues after the tokens already sent
        while True:
            gen = Generation(state["model"], prompt, req.max_tokens - base, params, eos_ids=cfg.eos_token_ids,
                             ignore_eos=req.ignore_eos, cache=cache, mtp=spec if attempt == 0 else None)
            try:
                for i, tok in enumerate(gen):
                    send(sock, Token(rid, int(tok), base + i), peer=peer)
                    if i == 0 and faults.hit("request_error"):
                        raise RuntimeError("injected request failure (COLI_INJECT=request_error)")
                    out_tokens.append(int(tok))
                    n = base + i + 1
                    counters["tokens"] += 1
                    pump(0)
                    if ticker.due():
                        publish_stats()
                reason = gen.stats.finish_reason
                break
            except Cancelled:
                reason = "cancelled"
                counters["cancelled"] += 1
                break
            except ExpertUnavailable as e:
                counters["failed"] += 1
                log.error("expert_unavailable", request_id=rid, error=str(e))
                send(sock, Error(ERROR_INTERNAL, f"expert unavailable: {e}", rid), peer=peer)
                state["current"] = None
                if sess is not None:
                    sess.tokens = (list(req.prompt_ids) + out_tokens)[:sess.cache.length]
                    commit_session(sess, rid)
                return
            except Exception as e:
                if attempt > 0 or state["vx"] is None or not _gpu_fatal(e):
                    raise
                attempt += 1
                demote(e)
                # go on from what the client has: the prompt and the tokens sent so far, on the CPU
                base = n
                if base >= req.max_tokens:
                    reason = "length"
                    break
                full = list(req.prompt_ids) + out_tokens
                if sess is not None:      # the session's cache lived on the GPU: take it up again on the CPU
                    sess = sessions.get(req.session, create=True, ephemeral=req.ephemeral)
                    prompt, cache = sess.reuse(full), sess.cache
                else:
                    prompt, cache = full, None
            finally:
                finish_vram()
        state["current"] = None
        if req.session is not None:   # the MTP side of the conversation, for its next turn (memory only)
            if getattr(gen, "mtp_carry", None) is not None:
                carries[req.session] = gen.mtp_carry
            else:
                carries.pop(req.session, None)
        if sess is not None:  # the tokens the cache now covers: prompt, then what was fed back
            sess.tokens = (list(req.prompt_ids) + out_tokens)[:sess.cache.length]
            err = commit_session(sess, rid)    # saved before Done: a turn the client saw finish survives kill -9
            if err:
                send(sock, Error(ERROR_INTERNAL, f"the answer was generated but {err}", rid), peer=peer)
                return
        dt = time.perf_counter() - t0
        counters["prefill_s"] += gen.stats.prefill_s
        counters["decode_s"] += gen.stats.decode_s
        counters["last_tokens_per_s"] = round(gen.stats.decode_tps, 3)
        counters["last_latency_s"] = round(dt, 4)
        timing = {"prefill_s": gen.stats.prefill_s, "decode_s": gen.stats.decode_s, "total_s": dt,
                  "decode_tokens_per_s": gen.stats.decode_tps, "prefill_tokens": len(new_ids),
                  "reused_tokens": reused}
        if gen.stats.mtp is not None:
            ms = gen.stats.mtp
            timing.update(mtp_rounds=ms["rounds"], mtp_tokens_per_step=ms["tokens_per_step"],
                          **{f"mtp_acceptance_{j + 1}": a for j, a in enumerate(ms["acceptance_per_position"])
                             if a is not None})
            for key in ("rounds", "tokens"):
                counters[f"mtp_{key}"] = counters.get(f"mtp_{key}", 0) + ms[key]
            for j, (d, a) in enumerate(zip(ms["drafted"], ms["accepted"])):
                counters[f"mtp_drafted_{j + 1}"] = counters.get(f"mtp_drafted_{j + 1}", 0) + d
                counters[f"mtp_accepted_{j + 1}"] = counters.get(f"mtp_accepted_{j + 1}", 0) + a
        send(sock, Done(rid, reason, n, timing), peer=peer)
        log.info("request", request_id=rid, prompt_tokens=len(req.prompt_ids), reused_tokens=reused,
                 session=req.session, tokens=n, finish=reason,
                 total_s=round(dt, 4), decode_tps=round(gen.stats.decode_tps, 2))

    def request_failed(peer: bytes, req: GenerateRequest, e: Exception) -> None:
        """Any exception serve() did not handle: an Error for this request (typed, naming the cause), the
        traceback in the log, and the executor goes on with the next request. A session the request was
        using goes back to its last finished turn (SessionStore.recover)."""
        state["current"] = None
        counters["failed"] += 1
        code = ERROR_BAD_REQUEST if isinstance(e, ContextTooLong) else ERROR_INTERNAL
        what = str(e) if code == ERROR_BAD_REQUEST else f"the executor failed on this request: {type(e).__name__}: {e}"
        log.exception("request_failed", request_id=req.request_id, session=req.session, error=f"{type(e).__name__}: {e}")
        if req.session is not None:
            sessions.recover(req.session)
        try:
            send(sock, Error(code, what[:2000], req.request_id), peer=peer)
        except zmq.ZMQError as se:
            log.error("error_not_sent", request_id=req.request_id, error=str(se))

    try:
        while not state["stop"]:
            try:
                pump(ticker.timeout_ms() + 1)
            except StopRequested:
                break
            except Cancelled:
                continue
            if ticker.due():
                publish_stats()
            while inbox and not state["stop"]:
                peer, req = inbox.pop(0)
                state["session"] = req.session
                try:
                    serve(peer, req)
                except StopRequested:
                    break
                except Exception as e:      # one request's failure is that request's Error, never the run's
                    request_failed(peer, req, e)
                finally:
                    state["session"] = None
                    for name in state.pop("drop_after", ()):
                        state.get("mtp_carry", {}).pop(name, None)
                        log.info("session_dropped", session=name, found=sessions.drop(name))
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
        state["model"] = state["vx"] = None
        del model, experts, table, sessions
        gc.collect()
        for a in (tarena, arena):
            try:
                a.close()
            except Exception as e:
                log.warning("arena_close", error=str(e))
        log.info("stopped", **{k: v for k, v in counters.items() if isinstance(v, int)})


def _gpu_fatal(e: Exception) -> bool:
    """Whether an error means the CUDA context is gone (the run must leave the GPU)."""
    from coli.gpu.driver import DriverError
    from coli.gpu.vram_experts import GpuLost
    if isinstance(e, GpuLost) or (isinstance(e, DriverError) and e.fatal):
        return True
    text = str(e).lower()
    return any(w in text for w in ("illegal address", "context is destroyed", "launch failed", "unspecified launch",
                                   "device-side assert", "gpu lost", "cuda_error_unknown"))


def _gpu_model(cfg, weights, backend, experts, arena, table, gpu: dict, faults, log, state):
    """The model on the CUDA backend with the VRAM expert cache over the RAM tier's arena. -> (model, source)."""
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
    if vram_gb is None and slots is None:       # no budget given: what the device has free, less a margin
        free, _total = backend.rt.drv.mem_get_info()
        vram_gb = (backend.rt.pool.active_bytes + 0.9 * free) / 1e9
    vx, plan = build_vram_experts(model, host, cfg, weights.record_layout, vram_gb=vram_gb, slots=slots,
                                  max_context=int(gpu.get("max_context") or 4096), policy=gpu.get("policy") or "freq",
                                  tile_bytes=int(gpu.get("tile_kb") or 1024) * 1024,
                                  faults=faults if faults.rates else None, log=log)
    state["vram"] = plan["line"]
    state["gpu_name"] = backend.rt.name
    log.info("vram_pool", **{k: v for k, v in plan.items() if k != "line"}, line=plan["line"])
    return model, vx
