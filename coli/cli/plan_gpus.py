"""`coli plan --gpus 0,1`: the model placed on several GPUs of one host (issue 18; the math is coli/gpu/partition.py).
Prints each GPU's share (dense layers, KV, experts owned, slot pool), the hand-offs per token and the cold-token
ceiling with one link per GPU, against one GPU's. The RAM tier is one pinned arena shared by every GPU, sized as
`coli plan` without --gpus sizes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from coli.errors import ColiError

GB = 1e9


def _config(model: Path | None, preset: str | None):
    from coli.config import load_config
    from coli.config import preset as get_preset

    return get_preset(preset) if preset is not None else load_config(model)


def _machine(spec, vram_text, pcie_text):
    """[(index, vram bytes, link GB/s, where each figure came from)] in --gpus order."""
    from coli import probe
    from coli.cli.plan import ASSUMED_PCIE_GBPS
    from coli.gpu.gpu_select import AUTO, per_gpu, resolve_gpus, visible_gpus

    listed, why = [], None
    if spec == AUTO or vram_text is None or pcie_text is None:
        listed, why = probe.gpus()
        visible = visible_gpus([g.index for g in listed], os.environ.get("CUDA_VISIBLE_DEVICES"))
        idx = resolve_gpus(spec, visible, why)
    else:
        idx = spec
    by_index = {g.index: g for g in listed}
    n = len(idx)
    vram = per_gpu(vram_text, n, "--vram-gb") if vram_text is not None else None
    pcie = per_gpu(pcie_text, n, "--pcie-gbps") if pcie_text is not None else None
    out = []
    for k, i in enumerate(idx):
        g = by_index.get(i)
        if vram is not None:
            v, vs = vram[k] * GB, "given"
        else:
            v, vs = g.memory_total, f"detected: {g.name}"
        if pcie is not None:
            link, ls = pcie[k], "given"
        elif g is not None and g.pcie_gbps:
            link, ls = g.pcie_gbps, f"detected: PCIe Gen{g.pcie_gen} x{g.pcie_width} at 88% of its raw rate"
        else:
            link, ls = ASSUMED_PCIE_GBPS, "assumed: PCIe Gen4 x16 (pass --pcie-gbps)"
        out.append((i, int(v), link, {"vram": vs, "pcie": ls}))
    return out


def _trace_idx(path: Path, geom):
    from coli.trace import TraceFormatError, read_trace

    if not path.is_file():
        raise ColiError(f"--trace {path}: no such file (record one with coli run --record-routing FILE)")
    try:
        t = read_trace(path)
    except (TraceFormatError, OSError) as e:
        raise ColiError(f"--trace {path}: {e}") from None
    h = t.header
    want = (len(geom.moe_layers), geom.experts_per_layer, geom.experts_per_token)
    if (h.n_layers, h.n_experts, h.top_k) != want:
        raise ColiError(f"--trace {path}: recorded for {h.n_layers} MoE layers x {h.n_experts} experts, top-{h.top_k}; "
                        f"this model has {want[0]} x {want[1]}, top-{want[2]}: record a trace of this model")
    if t.n_tokens == 0:
        raise ColiError(f"--trace {path}: no complete token in it")
    return t.idx


def plan_gpus(model, preset, gpus_text, vram_text, pcie_text, context, kv_dtype, experts, dense, group,
              vram_reserve_gb, partition, dense_placement, trace, peer_access, as_json, unused=()) -> None:
    from coli.cli.common import clean_errors

    clean_errors(_refuse_unused)(unused)
    clean_errors(_plan_gpus)(model, preset, gpus_text, vram_text, pcie_text, context, kv_dtype, experts, dense, group,
                             vram_reserve_gb, partition, dense_placement, trace, peer_access, as_json)


def _refuse_unused(unused) -> None:
    # the RAM tier and the disk are the one-GPU plan's; taking them here silently would suggest they were used
    if unused:
        raise ColiError(f"{unused[0]} is not used with --gpus (the RAM tier and disk are shared by the GPUs): plan them "
                        f"with `coli plan` without --gpus")


def _plan_gpus(model, preset, gpus_text, vram_text, pcie_text, context, kv_dtype, experts, dense, group,
               vram_reserve_gb, partition, dense_placement, trace, peer_access, as_json) -> None:
    from coli.cli.plan import _sizes
    from coli.gpu.gpu_select import parse_gpus
    from coli.gpu.partition import PARTITIONS, GpuBudget, PartitionOptions, choose, make_partition
    from coli.plan import KV_BYTES, partition_geometry

    spec = parse_gpus(gpus_text)          # bad --gpus text fails before any probe or size computation
    if partition not in PARTITIONS + ("auto",):
        raise ColiError(f"--partition must be layer, expert or auto, got {partition!r}")
    if kv_dtype not in KV_BYTES:
        raise ColiError(f"--kv-dtype must be one of {', '.join(KV_BYTES)}, got {kv_dtype!r}")
    sizes = _sizes(model, preset, experts, dense, group)
    cfg = _config(model, preset)
    ctx = context if context is not None else min(8192, sizes.max_context)
    if ctx > sizes.max_context:
        raise ColiError(f"--context {ctx} exceeds the model's max_position_embeddings {sizes.max_context}: lower "
                        f"--context")
    geom = partition_geometry(cfg, sizes, ctx, kv_dtype)
    machine = _machine(spec, vram_text, pcie_text)
    budgets = [GpuBudget(i, v, link) for i, v, link, _ in machine]
    idx = _trace_idx(trace, geom) if trace is not None else None
    o = PartitionOptions(experts_by="expert" if partition == "auto" else partition, dense=dense_placement,
                         reserve_bytes=int(vram_reserve_gb * GB), peer_access=peer_access)
    if partition == "auto":
        c = choose(geom, budgets, o, idx)
        plan, why, cands = c.chosen, c.why, c.candidates
    else:
        plan, why, cands = make_partition(geom, budgets, o, idx), f"--partition {partition}", None
    if as_json:
        d = {"plan": plan.to_dict(), "chosen_because": why, "context": ctx, "kv_dtype": kv_dtype,
             "sources": {str(i): src for i, _, _, src in machine}, "model_source": sizes.source}
        if cands:
            d["candidates"] = {p: ({"tokens_per_s": c.tokens_per_s, "handoffs": c.handoffs, "dense": c.dense}
                                   if not isinstance(c, str) else {"refused": c}) for p, c in cands.items()}
        print(json.dumps(d))
        return
    show(plan, why, cands, machine, sizes, ctx, kv_dtype)


def _b(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _ranges(rs) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in rs) or "-"


def _tps(v) -> str:
    return "n/a" if v is None else f"{v:.2f} tok/s"


def show(p, why, cands, machine, sizes, ctx, kv_dtype) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False)
    m = p.model
    con.print(f"[bold]coli plan --gpus[/] — {sizes.source}")
    con.print(f"model: {m['layers']} layers ({m['moe_layers']} MoE) x {m['experts_per_layer']} experts, "
              f"top-{m['experts_per_token']}; expert {_b(m['record_bytes'])}; dense core {_b(m['dense_bytes'])} "
              f"({sizes.dense_format}); KV {_b(m['kv_bytes'])} for {ctx:,} tokens ({kv_dtype})")
    con.print("machine: " + "; ".join(f"GPU {i} {v / GB:g} GB ({src['vram']}), link {link:.2f} GB/s ({src['pcie']})"
                                      for i, v, link, src in machine))
    where = ("whole on GPU " + str(p.home[0])) if p.dense == "whole" else "split by layer range"
    con.print(f"partition: routed experts by {'MoE-layer range' if p.partition == 'layer' else 'expert id'} "
              f"({why}); dense core {where}; routing {p.routing}")
    t = Table(title="per GPU (each row's parts sum to its budget)", title_justify="left")
    for col, just in (("GPU", "right"), ("budget", "right"), ("link", "right"), ("reserve", "right"),
                      ("dense core (layers)", "left"), ("KV", "right"), ("experts owned", "left"),
                      ("slot pool", "right"), ("free", "right"), ("copies/token", "right")):
        t.add_column(col, justify=just)
    for g in p.gpus:
        extra = "+".join(x for x, on in (("embed", g["embedding"]), ("lm_head", g["lm_head"])) if on)
        owned = f"{g['experts_owned']:,}" + (f" (MoE layers {_ranges(g['moe_layers_owned'])})"
                                             if p.partition == "layer" else "")
        hit = g["hit_rate_vram_uniform"]
        t.add_row(str(g["index"]), _b(g["vram_budget"]), f"{g['link_gbps']:.1f} GB/s", _b(g["reserve"]),
                  f"{_b(g['dense_core'])} ({_ranges(g['dense_layers'])}{' +' + extra if extra else ''})",
                  _b(g["kv_cache"]), owned,
                  f"{g['expert_slots']:,} slots = {_b(g['expert_slot_bytes'])}"
                  + (f" ({100 * hit:.1f}% of its experts)" if hit is not None else ""),
                  _b(g["free"]), f"{g['copies_per_token']:.1f}")
    con.print(t)
    h = p.handoffs
    con.print(f"hand-offs per token: {h['crossings']:.1f} crossings ({h['layer_boundaries']} at layer-range "
              f"boundaries + {h['expert_round_trips']:.1f} to and from the GPUs owning a layer's selected experts) "
              f"x {_b(h['bytes_per_crossing'])} = {_b(h['bytes'])} through {h['path']} memory" if h["path"] !=
              "peer" else f"hand-offs per token: {h['crossings']:.1f} crossings over peer access = {_b(h['bytes'])}")
    con.print(f"  ~{h['host_s'] * 1e3:.2f} ms of host time per token at an assumed {h['host_us_per_crossing']:g} us "
              f"per crossing{'' if h['path_known'] else ' (peer access not known: --peer-access if it is)'}")
    tps = p.tokens_per_s
    con.print("[bold]cold-token ceiling[/] (copies only, one link per GPU; every routed expert crosses):")
    con.print(f"  one GPU (GPU {p.gpus[0]['index']}'s link alone): {_tps(tps['one_gpu_cold'])}")
    con.print(f"  one sequence:                  {_tps(tps['cold_one_sequence'])}  "
              f"({tps['speedup_cold_one_sequence']:.2f}x one GPU)")
    con.print(f"  {len(p.gpus)}+ sequences in flight:        {_tps(tps['cold_pipelined'])}  "
              f"({tps['speedup_cold_pipelined']:.2f}x one GPU; the busiest link bounds it)")
    exp = tps["expected_one_sequence"]
    con.print("  expected with each GPU's pool: " + ("no copies once warm (every owned expert fits its GPU)"
                                                    if exp is None and tps["cold_one_sequence"] else _tps(exp)))
    if cands:
        parts = []
        for name, c in cands.items():
            if isinstance(c, str):
                parts.append(f"by {name}: does not fit ({c})")
            else:
                ct = c.tokens_per_s
                parts.append(f"by {name}: {ct['speedup_cold_one_sequence']:.2f}x one sequence, "
                             f"{ct['speedup_cold_pipelined']:.2f}x pipelined, {c.handoffs['crossings']:.1f} "
                             f"hand-offs, dense {c.dense}")
        con.print("compared: " + " | ".join(parts))
    con.print("assumptions: " + "; ".join(p.assumptions) + "; the RAM tier is one pinned arena every GPU copies "
              "from (size it with `coli plan` without --gpus)")
    con.print("[yellow]note:[/] the planner only: `coli up/run` still use one GPU (issue 18: per-GPU pools, lanes "
              "and hand-offs are not built yet)")
