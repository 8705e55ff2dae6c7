"""`coli plan`: where each part of a model goes on this machine (or the one described) and the tokens/s
bounds each tier implies; refuses a plan that cannot run and says what to change. The math is coli/plan.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors
from coli.errors import ColiError
from coli.plan import DEFAULT_DENSE

ASSUMED_DISK_GBPS = 6.0    # a consumer Gen4 NVMe (ARCHITECTURE §1: 6-11 GB/s)
ASSUMED_PCIE_GBPS = 25.0   # PCIe Gen4 x16 at ~88% of its raw rate


def _numbers(option: str, minimum: float | None):
    """--vram-gb / --pcie-gbps: one number, or one per GPU (16,24); bad text is a usage error naming the option."""
    def check(value: Optional[str]) -> Optional[str]:
        from coli.gpu.gpu_select import parse_numbers

        if value is not None:
            try:
                parse_numbers(value, option, minimum_exclusive=None if minimum is not None else 0.0, minimum=minimum)
            except ColiError as e:
                raise typer.BadParameter(str(e)) from None
        return value
    return check


def plan(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="A ColiStream container (real sizes from its "
                                         "manifest) or a Hugging Face checkpoint (sizes as converted)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="A config preset instead of a model (glm5, tiny)."),
    vram_gb: Optional[str] = typer.Option(None, "--vram-gb", callback=_numbers("--vram-gb", 0.0), help="GPU memory "
                                          "in GB (default: detected; 0 = CPU path); with --gpus one for all or one "
                                          "per GPU (16,24)."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM in GB (default: detected MemTotal)."),
    disk_gbps: Optional[float] = typer.Option(None, "--disk-gbps", help="NVMe read GB/s (default: measured on "
                                              "--model's files, else 6.0 assumed)."),
    pcie_gbps: Optional[str] = typer.Option(None, "--pcie-gbps", callback=_numbers("--pcie-gbps", None),
                                            help="Host-to-GPU GB/s (default: from the detected link, else 25 "
                                            "assumed); with --gpus one for all or one per GPU's own link."),
    context: Optional[int] = typer.Option(None, "--context", min=1, help="Context length the KV cache is sized for "
                                          "(default 8192, or the model's limit if smaller)."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="bf16 | fp32."),
    experts: str = typer.Option("int4", "--experts", help="Expert format for --preset / a checkpoint."),
    dense: str = typer.Option(DEFAULT_DENSE, "--dense", help="Dense-core format for --preset / a checkpoint (the "
                              "default is `coli convert`'s; a plan that does not fit says which format does)."),
    group: int = typer.Option(64, "--group", help="Quantisation group size for int4/int2."),
    vram_reserve_gb: float = typer.Option(1.0, "--vram-reserve-gb", min=0.0, help="VRAM kept for CUDA and workspaces."),
    ram_reserve_gb: float = typer.Option(4.0, "--ram-reserve-gb", min=0.0, help="RAM kept for the OS and processes."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="Place the model on several GPUs of this host: indices "
                                       "(0,1) or auto (every visible GPU); see docs/gpu.md 'Several GPUs'."),
    partition: str = typer.Option("auto", "--partition", help="With --gpus: routed experts by 'layer' range, by "
                                  "'expert' id, or 'auto' (plan both, keep the higher cold ceiling)."),
    dense_placement: str = typer.Option("auto", "--dense-placement", help="With --gpus: the dense core 'whole' on "
                                        "one GPU, 'split' by layer range, or 'auto'."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="With --gpus: balance the experts from this routing "
                                         "trace (coli run --record-routing) instead of uniform routing."),
    peer_access: Optional[bool] = typer.Option(None, "--peer-access/--no-peer-access", help="With --gpus: whether "
                                               "the GPUs reach each other's memory (default: not known, counted as "
                                               "hand-offs through pinned host memory)."),
) -> None:
    """Place a model on a machine: dense core, VRAM and RAM expert slots, pins, KV budget, tokens/s bounds."""
    if gpus is not None:
        from coli.cli.plan_gpus import plan_gpus

        unused = [o for o, v in (("--ram-gb", ram_gb), ("--disk-gbps", disk_gbps)) if v is not None]
        plan_gpus(model, preset, gpus, vram_gb, pcie_gbps, context, kv_dtype, experts, dense, group, vram_reserve_gb,
                  partition, dense_placement, trace, peer_access, as_json, unused)
        return
    _plan(model, preset, _one(vram_gb, "--vram-gb"), ram_gb, disk_gbps, _one(pcie_gbps, "--pcie-gbps"), context,
          kv_dtype, experts, dense, group, vram_reserve_gb, ram_reserve_gb, as_json)


@clean_errors
def _one(value: Optional[str], option: str) -> Optional[float]:
    from coli.gpu.gpu_select import parse_numbers

    if value is None:
        return None
    vals = parse_numbers(value, option, minimum_exclusive=None, minimum=float("-inf"))
    if len(vals) > 1:
        raise ColiError(f"{option} {value!r} gives {len(vals)} values: one value per GPU needs --gpus (e.g. --gpus "
                        f"{','.join(map(str, range(len(vals))))})")
    return vals[0]


def _sizes(model, preset, experts, dense, group):
    from coli.config import load_config
    from coli.config import preset as get_preset
    from coli.container.format import MANIFEST_NAME
    from coli.model_store import check_model_dir
    from coli.plan import sizes_from_config, sizes_from_container

    if (model is None) == (preset is None):
        raise ColiError("give exactly one of --model DIR and --preset NAME (e.g. --preset glm5)")
    if preset is not None:
        return sizes_from_config(get_preset(preset), f"preset {preset}", experts, dense, group)
    check_model_dir(model)
    if (model / MANIFEST_NAME).is_file():
        return sizes_from_container(model)
    return sizes_from_config(load_config(model), model.name, experts, dense, group)


def hardware(model, vram_gb, ram_gb, disk_gbps, pcie_gbps, expert_matrix=None):
    from coli import probe
    from coli.plan import Hardware

    src = {}
    gpu_list, why = ([], None) if (vram_gb is not None and pcie_gbps is not None) else probe.gpus()
    if vram_gb is None:
        if gpu_list:
            vram_gb = gpu_list[0].memory_total / 1e9
            src["vram"] = f"detected: GPU 0 {gpu_list[0].name}"
        else:
            vram_gb = 0.0
            src["vram"] = f"no GPU detected ({why}): the CPU path"
    else:
        src["vram"] = "given"
    if ram_gb is None:
        ram_gb = probe.meminfo().get("MemTotal", 0) / 1e9
        src["ram"] = "detected: MemTotal"
    else:
        src["ram"] = "given"
    if disk_gbps is None:
        files = probe.expert_files(model) if model is not None else []
        if files:
            rs = probe.read_speed(files)
            disk_gbps = rs.gbps
            src["disk"] = f"measured: {rs.nbytes / 2**20:.1f} MiB of {model} in {rs.seconds:.3f} s" + \
                          (" with O_DIRECT" if rs.direct else "") + (f" ({rs.note})" if rs.note else "")
        else:
            disk_gbps = ASSUMED_DISK_GBPS
            src["disk"] = "assumed: a consumer Gen4 NVMe (pass --disk-gbps, or --model CONTAINER to measure)"
    else:
        src["disk"] = "given"
    if pcie_gbps is None:
        link = gpu_list[0].pcie_gbps if gpu_list else None
        if link:
            pcie_gbps = link
            src["pcie"] = f"detected: PCIe Gen{gpu_list[0].pcie_gen} x{gpu_list[0].pcie_width} at 88% of its raw rate"
        else:
            pcie_gbps = ASSUMED_PCIE_GBPS
            src["pcie"] = "assumed: PCIe Gen4 x16 (pass --pcie-gbps)"
    else:
        src["pcie"] = "given"
    cpu_expert_s = cpu_gemv_gbps = None
    if vram_gb == 0 and expert_matrix is not None:
        # The CPU path is bound by numpy work, not transfers (docs/perf-notes.md): measure it here (~1-2 s).
        speed = probe.cpu_expert_speed(*expert_matrix)
        cpu_expert_s, cpu_gemv_gbps = speed.expert_s, speed.gemv_gbps
        src["cpu"] = f"measured: {speed.note}"
    return Hardware(vram_gb=round(vram_gb, 3), ram_gb=round(ram_gb, 3), disk_gbps=disk_gbps, pcie_gbps=pcie_gbps,
                    cpu_expert_s=cpu_expert_s, cpu_gemv_gbps=cpu_gemv_gbps, sources=src)


@clean_errors
def _plan(model, preset, vram_gb, ram_gb, disk_gbps, pcie_gbps, context, kv_dtype, experts, dense, group,
          vram_reserve_gb, ram_reserve_gb, as_json):
    from coli.plan import PlanOptions, make_plan

    sizes = _sizes(model, preset, experts, dense, group)
    hw = hardware(model, vram_gb, ram_gb, disk_gbps, pcie_gbps, sizes.expert_matrix)
    p = make_plan(sizes, hw, PlanOptions(context=context, kv_dtype=kv_dtype, vram_reserve_gb=vram_reserve_gb,
                                         ram_reserve_gb=ram_reserve_gb))
    if as_json:
        print(json.dumps(p.to_dict(), indent=1))
    else:
        show(p)
    if not p.ok:
        raise ColiError("this plan cannot run: " + " | ".join(p.problems))


def _b(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _tps(v) -> str:
    return "n/a" if v is None else f"{v:.2f} tok/s"


def show(p) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False)
    m, hw, s, kv, pt, tps = p.model, p.hardware, p.slots, p.kv, p.per_token, p.tokens_per_s
    con.print(f"[bold]coli plan[/] — {m['source']}")
    con.print(f"model: {m['moe_layers']} MoE layers x {m['experts_per_layer']} experts, top-{m['experts_per_token']}; "
              f"expert {_b(m['expert_bytes'])} ({m['expert_format']}); routed {_b(m['routed_bytes'])}; dense core "
              f"{_b(m['dense_bytes'])} ({m['dense_format']}); KV {kv['values_per_token']:,} values/token = "
              f"{_b(kv['bytes_per_token'])}/token ({kv['dtype']})")
    src = hw["sources"]
    con.print(f"machine: VRAM {hw['vram_gb']:g} GB ({src.get('vram')}); RAM {hw['ram_gb']:g} GB ({src.get('ram')}); "
              f"disk {hw['disk_gbps']:.2f} GB/s ({src.get('disk')}); PCIe {hw['pcie_gbps']:.2f} GB/s ({src.get('pcie')})"
              + (f"; CPU {hw['cpu_expert_s'] * 1e3:.0f} ms per routed expert, float32 GEMV {hw['cpu_gemv_gbps']:.2f} "
                 f"GB/s ({src.get('cpu')})" if hw.get("cpu_expert_s") is not None else ""))
    for title, tier, rows in (
        ("VRAM", p.vram, [("reserve (CUDA context, workspaces)", "reserve", ""),
                          ("dense core (resident)", "dense_core", ""),
                          (f"KV cache ({kv['context']:,} tokens)", "kv_cache", ""),
                          ("expert slots", "expert_slots",
                           f"{s['vram']:,} slots, {s['vram_per_layer']:.1f} per layer"),
                          ("free", "free", "")]),
        ("RAM", p.ram, [("reserve (OS, stage processes)", "reserve", ""),
                        ("dense core (CPU path)", "dense_core", ""),
                        ("KV cache (CPU path)", "kv_cache", ""),
                        ("expert slots (/dev/shm arena)", "expert_slots",
                         f"{s['ram']:,} slots, {s['ram_per_layer']:.1f} per layer: {s['ram_pinned']:,} pinned "
                         f"(learned) + {s['ram_lru']:,} LRU"),
                        ("free", "free", "")])):
        if title == "VRAM" and p.device == "cpu":
            continue
        t = Table(title=f"{title} {_b(tier['total'])}", title_justify="left")
        t.add_column("part")
        t.add_column("bytes", justify="right")
        t.add_column("detail")
        for label, key, detail in rows:
            if tier[key] or key in ("free", "expert_slots"):
                t.add_row(label, _b(tier[key]), detail)
        t.add_row("[bold]total[/]", f"[bold]{_b(tier['total'])}[/]", "")
        con.print(t)
    kt = Table(title=f"KV budget per context length ({kv['where']}; at most {kv['max_context_that_fits']:,} tokens fit "
                     f"beside the minimum expert slots)", title_justify="left")
    kt.add_column("context", justify="right")
    kt.add_column("KV bf16", justify="right")
    kt.add_column("KV fp32", justify="right")
    if p.device == "gpu":
        kt.add_column(f"VRAM expert slots left ({kv['dtype']})", justify="right")
    for r in kv["by_context"]:
        row = [f"{r['context']:,}", _b(r["bytes_bf16"]), _b(r["bytes_fp32"])]
        if p.device == "gpu":
            row.append("does not fit" if r["vram_expert_slots"] is None else f"{r['vram_expert_slots']:,}")
        kt.add_row(*row)
    con.print(kt)
    con.print(f"per decoded token: {pt['routed_experts']} routed experts = {pt['vram_hits']:.1f} VRAM hits "
              f"({100 * pt['hit_rate_vram']:.1f}%) + {pt['ram_hits']:.1f} RAM hits + {pt['disk_reads']:.1f} disk reads "
              f"({100 * (1 - pt['hit_rate_ram_or_vram']):.1f}%); {_b(pt['routed_bytes'])} routed = "
              f"{_b(pt['bytes_from_disk'])} from disk"
              + (f", {_b(pt['bytes_over_pcie'])} over PCIe" if p.device == "gpu" else ""))
    con.print("[bold]tokens/s bounds[/]" + (" (transfers only; GPU compute not counted):" if p.device == "gpu" else
                                            " (CPU path: disk transfers and numpy compute):"))
    con.print(f"  all cold from disk:  {_tps(tps['all_cold_disk'])}  ({_b(pt['routed_bytes'])} / "
              f"{hw['disk_gbps']:.2f} GB/s)")
    if p.device == "gpu":
        con.print(f"  all cold over PCIe:  {_tps(tps['all_cold_pcie'])}  ({_b(pt['routed_bytes'])} / "
                  f"{hw['pcie_gbps']:.2f} GB/s; every expert in RAM, none kept in VRAM)")
    if tps.get("cpu_compute") is not None:
        con.print(f"  CPU compute:         {_tps(tps['cpu_compute'])}  ({pt['routed_experts']} experts x "
                  f"{hw['cpu_expert_s'] * 1e3:.0f} ms + the float32 dense core at {hw['cpu_gemv_gbps']:.2f} GB/s = "
                  f"{pt['compute_s']:.1f} s per token)")
    if tps["expected"] is None:
        con.print("  expected:            no transfers once warm (bound by compute)")
    else:
        con.print(f"  expected:            {_tps(tps['expected'])}  (bound by {tps['expected_bound_by']}: disk "
                  f"{pt['disk_s']:.3f} s" + (f", PCIe {pt['pcie_s']:.3f} s" if p.device == "gpu" else "")
                  + (f", compute {pt['compute_s']:.1f} s" if pt.get("compute_s") else "") + " per token)")
    if p.dense_fits:
        con.print("dense formats on this GPU: " + "; ".join(
            f"--dense {f}: " + ("does not fit" if n is None else f"{n:,} expert slots") for f, n in p.dense_fits.items()))
    for w in p.warnings:
        con.print(f"[yellow]note:[/] {w}")
    con.print("assumptions: " + "; ".join(p.assumptions))
    for pr in p.problems:
        con.print(f"[red]cannot run:[/] {pr}")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
