"""`coli stats` as a pure function: a snapshot of the stages' latest counters -> a rich Table.

The snapshot is {stage: {counter: value, "t": time, ...}} as the supervisor republishes it; a
previous snapshot (for rates) is optional. Engines shown: NVMe reader, RAM tier, PCIe copy lanes and
SMs (from the executor; on the CPU path instead: compute busy and waiting for experts), CPU fallbacks, tokens/s,
the batch (running and waiting sequences, tokens per step, prefill vs decode share), request latency."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _rate(now: dict, prev: dict | None, key: str) -> float:
    if not prev or key not in prev or "t" not in prev or now.get("t", 0) <= prev["t"]:
        return 0.0
    return max(0.0, (now.get(key, 0) - prev[key]) / (now["t"] - prev["t"]))


def _pct(x: float) -> str:
    return f"{100 * x:5.1f} %"


def _on_gpu(e: dict, device: str | None) -> bool:
    if device is not None:
        return device in ("cuda", "gpu")
    return "vram_slots" in e or e.get("copy_busy", 0.0) > 0 or e.get("sm_busy", 0.0) > 0


def rows(snap: dict[str, dict[str, Any]], prev: dict[str, dict[str, Any]] | None = None,
         device: str | None = None) -> list[tuple[str, str, str]]:
    """`device` is the executor's ("cuda", "numpy", ...; from the run's status); None guesses from the counters."""
    prev = prev or {}
    out: list[tuple[str, str, str]] = []
    r = snap.get("reader")
    if r:
        busy = _rate(r, prev.get("reader"), "busy_s") / max(1, r.get("threads", 1))
        out += [("NVMe reader", "read rate", f"{_rate(r, prev.get('reader'), 'bytes') / 1e6:8.1f} MB/s"),
                ("", "queue depth", f"{r.get('queue_depth', 0)}"),
                ("", "busy", _pct(min(1.0, busy))),
                ("", "records / errors", f"{r.get('records', 0)} / {r.get('errors', 0)}")]
    m = snap.get("ramtier")
    if m:
        out += [("RAM tier", "hit rate", _pct(m.get("hit_rate", 0.0))),
                ("", "resident", f"{m.get('resident_bytes', 0) / 1e9:.3f} GB ({m.get('resident', 0)}/{m.get('slots', 0)} slots)"),
                ("", "pins", f"{m.get('pins', 0)}"),
                ("", "evictions", f"{m.get('evictions', 0)}")]
    e = snap.get("executor")
    if e:
        if "vram_slots" in e:
            out += [("VRAM cache", "hit rate", _pct(e.get("vram_hit_rate", 0.0))),
                    ("", "slots used", f"{e.get('vram_resident', 0)}/{e.get('vram_slots', 0)}"),
                    ("", "evictions", f"{e.get('evictions', 0)}"),
                    ("speculative lane", "busy", _pct(e.get("spec_busy", 0.0)))]
            if "ahead_layers" in e:   # long prefills' copies of the next MoE layer (coli/gpu/layer_ahead.py)
                first = f"; {e['ahead_first']} from a step's start" if "ahead_first" in e else ""
                out += [("", "layers copied ahead",
                         f"{e['ahead_layers']} ({e.get('ahead_bytes', 0) / 1e9:.3f} GB{first})")]
        if _on_gpu(e, device):
            out += [("PCIe copy lanes", "busy", _pct(e.get("copy_busy", 0.0))),
                    ("SMs", "busy", _pct(e.get("sm_busy", 0.0))),
                    ("CPU fallbacks", "experts", f"{e.get('cpu_fallbacks', 0)}")]
        else:  # the CPU path has no copy lanes or SMs: what its time goes to is compute and waiting for experts
            pe = prev.get("executor")
            # step_s: wall time in model steps (a batched step serves several requests: their own prefill and
            # decode times overlap, so their sum would count one second several times)
            forward = (_rate(e, pe, "step_s") if "step_s" in e
                       else _rate(e, pe, "prefill_s") + _rate(e, pe, "decode_s"))
            wait = _rate(e, pe, "wait_s")
            out += [("CPU compute (numpy)", "busy", _pct(min(1.0, max(0.0, forward - wait)))),
                    ("", "waiting for experts", _pct(min(1.0, wait))),
                    ("", "experts computed", f"{e.get('experts_served', 0)}")]
        out += [
                ("executor", "tokens/s (now)", f"{_rate(e, prev.get('executor'), 'tokens'):8.2f}"),
                ("", "tokens/s (last request)", f"{e.get('last_tokens_per_s', 0.0):8.2f}"),
                ("", "tokens / requests", f"{e.get('tokens', 0)} / {e.get('requests', 0)}")]
        if e.get("mtp_rounds"):   # MTP speculative decoding ran (docs/mtp.md)
            acc = [e.get(f"mtp_accepted_{j}", 0) / e[f"mtp_drafted_{j}"] for j in (1, 2, 3)
                   if e.get(f"mtp_drafted_{j}")]
            out += [("MTP drafts", "tokens per step", f"{e.get('mtp_tokens', 0) / e['mtp_rounds']:8.2f}"),
                    ("", "acceptance per position", " / ".join(_pct(a).strip() for a in acc) or "-")]
    if e and "steps" in e:
        out += batch_rows(e, prev.get("executor"), snap.get("supervisor"))
    s = snap.get("supervisor")
    if s:
        out += [("requests", "queued / running", f"{s.get('queued', 0)} / {s.get('running', 0)}"),
                ("", "done / cancelled / failed", f"{s.get('completed', 0)} / {s.get('cancelled', 0)} / {s.get('failed', 0)}"),
                ("", "last latency", f"{s.get('last_latency_s', 0.0):.3f} s")]
    return out


def batch_rows(e: dict, pe: dict | None, sup: dict | None) -> list[tuple[str, str, str]]:
    """The executor's batch (continuous batching): sequences in it and waiting (at the executor, plus the requests
    the supervisor holds back), tokens fed per step and the prefill share of them, over the interval since `pe`
    (since the start without one)."""
    base = pe if pe and pe.get("steps", 0) <= e.get("steps", 0) else {}
    steps = e.get("steps", 0) - base.get("steps", 0)
    pre = e.get("prefill_tokens_fed", 0) - base.get("prefill_tokens_fed", 0)
    dec = e.get("decode_tokens_fed", 0) - base.get("decode_tokens_fed", 0)
    rows_ = e.get("rows", 0) - base.get("rows", 0)
    waiting = e.get("batch_waiting", 0) + (sup or {}).get("queued", 0)
    share = f"{100 * pre / (pre + dec):.0f} % / {100 * dec / (pre + dec):.0f} %" if pre + dec else "-"
    return [("batch", "running / waiting", f"{e.get('batch_running', 0)} / {waiting} (max {e.get('max_batch', 1)})"),
            ("", "tokens per step", f"{(pre + dec) / steps:.1f}" if steps else "-"),
            ("", "sequences per step", f"{rows_ / steps:.1f}" if steps else "-"),
            ("", "prefill / decode tokens", share)] + _budget_row(e)


def _budget_row(e: dict) -> list[tuple[str, str, str]]:
    """Which token budget a step has: --prefill-chunk while the experts stream, else --step-tokens."""
    if "step_tokens" not in e:
        return []
    if e.get("experts_stream") and e.get("prefill_chunk") is not None:
        return [("", "step budget", f"{e['prefill_chunk']} tokens (experts stream: --prefill-chunk)")]
    return [("", "step budget", f"{e['step_tokens']} tokens (--step-tokens)")]


def render(snap: dict[str, dict[str, Any]], prev: dict[str, dict[str, Any]] | None = None, title: str = "",
           device: str | None = None) -> Table:
    t = Table(title=title or None, show_edge=False, pad_edge=False)
    t.add_column("engine", style="bold")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for row in rows(snap, prev, device):
        t.add_row(*row)
    if not snap:
        t.add_row("(no stats yet)", "", "")
    return t
