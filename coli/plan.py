"""`coli plan` placement math (pure: no I/O beyond reading a container's manifest; unit-tested).

Given a model's sizes and a machine's VRAM, RAM, disk and PCIe figures, decide where each part goes

    VRAM = reserve (CUDA context, kernel workspaces, activations) + dense core + KV cache
           + expert slots + free (less than one expert)
    RAM  = reserve (OS, stage processes) [+ dense core and KV cache on the CPU path]
           + expert slots (learned pins + LRU) + free

and the decode speed each tier implies. Tokens/s figures are bounds with the engines overlapped, so a token
costs max(disk time, PCIe time, CPU compute time); GPU compute is not counted (it is far below the copies),
CPU compute is (the numpy path decodes every routed expert and multiplies the float32 dense core per token,
at rates `coli plan` measures on this machine):

    all cold from disk    every routed expert of a token is read from NVMe
    all cold over PCIe    every routed expert is in RAM and crosses PCIe (none stays in VRAM)
    expected              hit rates the cache sizes imply under *uniform, independent routing*:
                          P(in VRAM) = VRAM slots per layer / experts per layer,
                          P(in RAM or VRAM) = max(RAM, VRAM slots per layer) / experts per layer
                          (the tiers are inclusive: an expert reaches VRAM through RAM)

Real GLM-5 routing is not uniform (ARCHITECTURE §1: a clairvoyant 8-slot-per-layer cache hits ~54%), so the
expected figure is a floor for a good cache policy; `coli stats` shows the measured hit rates. With uniform
routing the learned pins change nothing, so they are only sized here.

Bytes are decimal (GB = 1e9), as `coli up --ram-gb` counts them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from coli.config import ModelConfig

GB = 1e9
KV_BYTES = {"bf16": 2, "fp32": 4}
KV_CONTEXTS = (4096, 8192, 32768, 131072)


@dataclass(frozen=True)
class ModelSizes:
    name: str
    source: str
    moe_layers: int
    experts_per_layer: int
    experts_per_token: int
    expert_bytes: int
    dense_bytes: int
    kv_values_per_token: int
    max_context: int
    expert_format: str
    dense_format: str
    dense_bytes_all_quantized: int | None = None  # the dense core if every weight were in dense_format
    dense_params: int | None = None               # weights in the dense core (the CPU path holds them as float32)
    dense_params_per_token: int | None = None     # of those, the ones every decoded token multiplies (no embedding)
    dense_bytes_by_format: dict | None = None     # --dense format -> the dense core's bytes as convert writes it
    expert_matrix: tuple | None = None            # (rows, cols, fmt, group, tile_kb) of one expert matrix (probes)

    @property
    def routed_bytes(self) -> int:
        return self.moe_layers * self.experts_per_layer * self.expert_bytes

    @property
    def routed_per_token(self) -> int:
        return self.experts_per_token * self.moe_layers


def _fmt(fmt: str, group: int) -> str:
    return f"{fmt} g{group}" if fmt in ("int4", "int2") else fmt


# Dense formats `coli plan` tries when the asked one does not fit, largest (most faithful) first.
DENSE_CHOICES = ("bf16", "int8", "int4")
DEFAULT_DENSE = "int8"    # coli.container.writer.ConvertOptions.dense: what `coli convert` writes by default


def dense_core_bytes(cfg: ModelConfig, dense: str, group: int = 64, tile_kb: int = 512) -> int:
    """The dense-core file `coli convert --dense D --group G` writes for this config (its own layout code: tile
    padding, 4 KiB alignment, norms/routers/indexer heads kept f32)."""
    from coli.container.format import MatrixLayout, align
    from coli.container.writer import ConvertOptions, dense_format
    from coli.model.tensors import dense_shapes

    opts = ConvertOptions(dense=dense, group=group, tile_kb=tile_kb)
    n = 4096  # the file header
    for tname, shape in dense_shapes(cfg).items():
        rows, cols = shape if len(shape) == 2 else (1, math.prod(shape))
        n += align(MatrixLayout.make(rows, cols, dense_format(tname, shape, opts), group, tile_kb).nbytes)
    return n


def dense_core_parts(cfg: ModelConfig, dense: str, group: int = 64, tile_kb: int = 512) -> tuple[int, list[int], int]:
    """dense_core_bytes cut by where each part runs on several GPUs (coli/gpu/partition.py): (the embedding with the
    file header, each transformer layer's tensors, the final norm + lm_head); they sum to dense_core_bytes."""
    from coli.container.format import MatrixLayout, align
    from coli.container.writer import ConvertOptions, dense_format
    from coli.model.tensors import dense_shapes

    opts = ConvertOptions(dense=dense, group=group, tile_kb=tile_kb)
    embed, layers, head = 4096, [0] * cfg.num_hidden_layers, 0
    for tname, shape in dense_shapes(cfg).items():
        rows, cols = shape if len(shape) == 2 else (1, math.prod(shape))
        n = align(MatrixLayout.make(rows, cols, dense_format(tname, shape, opts), group, tile_kb).nbytes)
        if tname.startswith("model.layers."):
            layers[int(tname.split(".")[2])] += n
        elif tname.startswith("model.embed_tokens."):
            embed += n
        else:
            head += n
    return embed, layers, head


def partition_geometry(cfg: ModelConfig, m: ModelSizes, context: int, kv_dtype: str = "bf16"):
    """The geometry the multi-GPU planner places: per-layer dense bytes in the model's dense format (scaled to the
    real dense file when the sizes come from a container) and per-layer KV bytes at `context` tokens."""
    from coli.gpu.partition import Geometry

    fmt = m.dense_format.split()[0]
    group = int(m.dense_format.split()[1][1:]) if " g" in m.dense_format else 64
    tile_kb = m.expert_matrix[4] if m.expert_matrix else 512
    embed, layers, head = dense_core_parts(cfg, fmt if fmt in ("bf16", "f32", "int8", "int4", "int2") else "bf16",
                                           group, tile_kb)
    total = embed + sum(layers) + head
    if total != m.dense_bytes:   # a container: its dense file is the truth; keep the proportions
        layers = [round(n * m.dense_bytes / total) for n in layers]
        head = round(head * m.dense_bytes / total)
        embed = m.dense_bytes - sum(layers) - head
    per_value = KV_BYTES[kv_dtype] * context
    kv = [(cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim if t == "full" else 0)) * per_value
          for t in cfg.indexer_types]
    return Geometry(layer_types=tuple(cfg.mlp_layer_types), experts_per_layer=cfg.n_routed_experts,
                    experts_per_token=cfg.num_experts_per_tok, record_bytes=m.expert_bytes,
                    dense_layer_bytes=tuple(layers), embed_bytes=embed, lm_head_bytes=head, kv_layer_bytes=tuple(kv),
                    hidden_size=cfg.hidden_size, name=m.name)


def _dense_params(cfg: ModelConfig) -> tuple[int, int]:
    """(all dense-core weights, the ones a decoded token multiplies: all but the embedding table)."""
    from coli.model.tensors import dense_shapes

    shapes = dense_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    return total, total - math.prod(shapes.get("model.embed_tokens.weight", (0,)))


def _by_format(cfg: ModelConfig, group: int, tile_kb: int) -> dict:
    return {f: dense_core_bytes(cfg, f, group, tile_kb) for f in DENSE_CHOICES}


def sizes_from_config(cfg: ModelConfig, name: str, experts: str = "int4", dense: str = DEFAULT_DENSE,
                      group: int = 64, tile_kb: int = 512) -> ModelSizes:
    """Sizes of the container `coli convert --experts E --dense D --group G` would write for this config."""
    from coli.container.format import RecordLayout

    rec = RecordLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, experts, group, tile_kb)
    dense_bytes = dense_core_bytes(cfg, dense, group, tile_kb)
    params, per_token = _dense_params(cfg)
    bits = {"int4": 4 + 16 / group, "int2": 2 + 16 / group, "int8": 8, "bf16": 16, "f32": 32}[dense]
    return ModelSizes(name=name, source=f"{name}: sizes as `coli convert --experts {experts} --dense {dense} "
                                        f"--group {group}` writes them", moe_layers=len(cfg.moe_layers),
                      experts_per_layer=cfg.n_routed_experts, experts_per_token=cfg.num_experts_per_tok,
                      expert_bytes=rec.nbytes, dense_bytes=dense_bytes, kv_values_per_token=cfg.kv_values_per_token(),
                      max_context=cfg.max_position_embeddings, expert_format=_fmt(experts, group),
                      dense_format=_fmt(dense, group), dense_bytes_all_quantized=int(params * bits / 8),
                      dense_params=params, dense_params_per_token=per_token,
                      dense_bytes_by_format=_by_format(cfg, group, tile_kb),
                      expert_matrix=(rec.gate.rows, rec.gate.cols, rec.gate.fmt, group, tile_kb))


def sizes_from_container(model_dir: str | Path) -> ModelSizes:
    """Real sizes from a container's manifest (record length, dense.coli size)."""
    from coli.container.format import MANIFEST_NAME, parse_manifest
    from coli.config import load_config

    d = Path(model_dir)
    m = parse_manifest(d / MANIFEST_NAME)
    cfg = load_config(d)
    rec = m.record
    group, tile_kb = int(m.args.get("group") or 64), int(m.args.get("tile_kb") or 512)
    params, per_token = _dense_params(cfg)
    from coli.model.tensors import layer_of
    # the MTP layer's dense tensors (kept by coli convert, after the main ones) are not the dense core decode reads
    mtp_dense = sum(e.length for n, e in m.dense.items() if layer_of(n) == cfg.num_hidden_layers)
    note = f"; the MTP layer's {mtp_dense / 1e6:.1f} MB dense not counted" if mtp_dense else ""
    return ModelSizes(name=d.name, source=f"container {d} (manifest sizes{note})", moe_layers=len(cfg.moe_layers),
                      experts_per_layer=cfg.n_routed_experts, experts_per_token=cfg.num_experts_per_tok,
                      expert_bytes=rec.nbytes, dense_bytes=m.dense_file.size - mtp_dense,
                      kv_values_per_token=cfg.kv_values_per_token(), max_context=cfg.max_position_embeddings,
                      expert_format=_fmt(rec.gate.fmt, rec.gate.group),
                      dense_format=_fmt(str(m.args.get("dense", "?")), int(m.args.get("group") or 0)),
                      dense_params=params, dense_params_per_token=per_token,
                      dense_bytes_by_format=_by_format(cfg, group, tile_kb),
                      expert_matrix=(rec.gate.rows, rec.gate.cols, rec.gate.fmt, rec.gate.group, tile_kb))


@dataclass(frozen=True)
class Hardware:
    vram_gb: float
    ram_gb: float
    disk_gbps: float
    pcie_gbps: float
    cpu_expert_s: float | None = None   # CPU path: one routed expert for one token (decode + SwiGLU); None: not counted
    cpu_gemv_gbps: float | None = None  # CPU path: float32 weight bytes/s of the dense core's matrix-vector products
    sources: dict = field(default_factory=dict)  # figure -> "given" / "measured ..." / "detected ..." / "assumed ..."


@dataclass(frozen=True)
class PlanOptions:
    context: int | None = None  # None: 8192, or the model's max_position_embeddings if smaller
    kv_dtype: str = "bf16"
    vram_reserve_gb: float = 1.0
    ram_reserve_gb: float = 4.0
    pin_fraction: float = 0.25


@dataclass
class Plan:
    ok: bool
    device: str                      # "gpu" or "cpu"
    model: dict
    hardware: dict
    options: dict
    vram: dict                       # bytes by part; parts sum to "total"
    ram: dict                        # bytes by part; parts sum to "total"
    slots: dict                      # counts
    kv: dict
    per_token: dict
    tokens_per_s: dict
    problems: list[str] = field(default_factory=list)   # why it cannot run, each with what to change
    dense_fits: dict = field(default_factory=dict)       # GPU path: --dense format -> VRAM expert slots (None: no fit)
    warnings: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _gb(n: float) -> str:
    for unit, k in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def make_plan(m: ModelSizes, hw: Hardware, o: PlanOptions = PlanOptions()) -> Plan:
    if o.kv_dtype not in KV_BYTES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_BYTES)}, got {o.kv_dtype!r}")
    for name, v in (("--vram-gb", hw.vram_gb), ("--ram-gb", hw.ram_gb)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    for name, v in (("--disk-gbps", hw.disk_gbps), ("--pcie-gbps", hw.pcie_gbps)):
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if o.context is None:
        o = replace(o, context=min(8192, m.max_context))
    if o.context < 1:
        raise ValueError(f"--context must be >= 1, got {o.context}")
    problems: list[str] = []
    warnings: list[str] = []
    E, L, K, xb = m.experts_per_layer, m.moe_layers, m.experts_per_token, m.expert_bytes
    n_experts = L * E
    kv_tok = m.kv_values_per_token * KV_BYTES[o.kv_dtype]
    kv = kv_tok * o.context
    min_slots = 2 * K  # one layer's top-k computing while the next layer's arrive
    gpu = hw.vram_gb > 0
    vram_total, ram_total = int(hw.vram_gb * GB), int(hw.ram_gb * GB)
    if o.context > m.max_context:
        problems.append(f"--context {o.context} exceeds the model's max_position_embeddings {m.max_context}: "
                        f"lower --context")

    # ---- VRAM --------------------------------------------------------------------------------------------
    vram = {"reserve": 0, "dense_core": 0, "kv_cache": 0, "expert_slots": 0, "free": vram_total, "total": vram_total}
    vram_slots = 0
    dense_fits: dict = {}
    if gpu:
        reserve = min(int(o.vram_reserve_gb * GB), vram_total)
        for fmt, nbytes in (m.dense_bytes_by_format or {}).items():
            room = vram_total - reserve - nbytes - kv
            dense_fits[fmt] = min(room // xb, n_experts) if room >= min_slots * xb else None
        need = reserve + m.dense_bytes + kv + min_slots * xb
        if need > vram_total:
            problems.append(
                f"VRAM: the reserve ({_gb(reserve)}), the dense core ({_gb(m.dense_bytes)}, {m.dense_format}), the KV "
                f"cache for {o.context} tokens ({_gb(kv)}) and {min_slots} expert slots ({_gb(min_slots * xb)}) need "
                f"{_gb(need)}; --vram-gb is {hw.vram_gb:g}. Use a GPU with at least {math.ceil(need / GB)} GB, lower "
                f"--context{' or --kv-dtype bf16' if o.kv_dtype == 'fp32' else ''}"
                + ", or plan the CPU path with --vram-gb 0" + _dense_advice(m, dense_fits))
        else:
            left = vram_total - reserve - m.dense_bytes - kv
            vram_slots = min(left // xb, n_experts)
            vram.update(reserve=reserve, dense_core=m.dense_bytes, kv_cache=kv, expert_slots=vram_slots * xb,
                        free=left - vram_slots * xb)

    # ---- RAM ---------------------------------------------------------------------------------------------
    ram = {"reserve": 0, "dense_core": 0, "kv_cache": 0, "expert_slots": 0, "free": ram_total, "total": ram_total}
    reserve = min(int(o.ram_reserve_gb * GB), ram_total)
    dense_ram, kv_ram = (0, 0) if gpu else (_cpu_dense_bytes(m), kv)
    left = ram_total - reserve - dense_ram - kv_ram
    ram_slots = 0
    if left < min_slots * xb:
        need = reserve + dense_ram + kv_ram + min_slots * xb
        what = "" if gpu else f", the dense core in float32 ({_gb(dense_ram)}) and the KV cache ({_gb(kv_ram)}; CPU path)"
        problems.append(f"RAM: the reserve ({_gb(reserve)}){what} and {min_slots} expert slots need {_gb(need)}; "
                        f"--ram-gb is {hw.ram_gb:g}. Raise --ram-gb to at least {math.ceil(need / GB)}"
                        + ("" if gpu else ", or plan with a GPU (--vram-gb)"))
        ram.update(reserve=reserve, free=ram_total - reserve)
    else:
        ram_slots = min(left // xb, n_experts)
        ram.update(reserve=reserve, dense_core=dense_ram, kv_cache=kv_ram, expert_slots=ram_slots * xb,
                   free=left - ram_slots * xb)
    pinned = int(ram_slots * o.pin_fraction)
    slots = {"vram": int(vram_slots), "vram_per_layer": vram_slots / L, "ram": int(ram_slots),
             "ram_per_layer": ram_slots / L, "ram_pinned": pinned, "ram_lru": int(ram_slots - pinned),
             "experts_total": n_experts, "expert_bytes": xb, "shm_arena_bytes": int(ram_slots * xb)}
    if ram_slots and ram_slots >= n_experts:
        warnings.append("every expert fits in the RAM tier: after warm-up nothing is read from disk")
    if gpu and vram_slots >= n_experts:
        warnings.append("every expert fits in VRAM: nothing crosses PCIe after warm-up")

    # ---- KV budget per context length -------------------------------------------------------------------
    rows = []
    for ctx in sorted(set(KV_CONTEXTS + (o.context, m.max_context))):
        if ctx > m.max_context:
            continue
        row = {"context": ctx, "bytes_bf16": m.kv_values_per_token * 2 * ctx, "bytes_fp32": m.kv_values_per_token * 4 * ctx}
        if gpu:
            room = vram_total - min(int(o.vram_reserve_gb * GB), vram_total) - m.dense_bytes - kv_tok * ctx
            row["vram_expert_slots"] = int(room // xb) if room >= min_slots * xb else None  # None: does not fit
        rows.append(row)
    if gpu:
        room = vram_total - min(int(o.vram_reserve_gb * GB), vram_total) - m.dense_bytes - min_slots * xb
        max_ctx = max(0, min(m.max_context, room // kv_tok))
    else:
        room = ram_total - reserve - dense_ram - min_slots * xb
        max_ctx = max(0, min(m.max_context, room // kv_tok))
    kvd = {"values_per_token": m.kv_values_per_token, "dtype": o.kv_dtype, "bytes_per_token": kv_tok,
           "context": o.context, "bytes": kv, "where": "VRAM" if gpu else "RAM", "max_context_that_fits": int(max_ctx),
           "by_context": rows}

    # ---- per token and tokens/s --------------------------------------------------------------------------
    X = m.routed_per_token
    p_vram = min(vram_slots / L, E) / E if gpu else 0.0
    p_any = min(max(ram_slots, vram_slots) / L, E) / E
    vram_hits = X * p_vram
    ram_hits = X * (p_any - p_vram)
    disk_reads = X - vram_hits - ram_hits
    routed = X * xb
    disk_bytes = disk_reads * xb
    pcie_bytes = (ram_hits + disk_reads) * xb if gpu else 0.0
    t_disk = disk_bytes / (hw.disk_gbps * GB)
    t_pcie = pcie_bytes / (hw.pcie_gbps * GB) if gpu else 0.0
    t_compute = 0.0 if gpu else _cpu_compute_s(m, hw)
    t = max(t_disk, t_pcie, t_compute)
    per_token = {"routed_experts": X, "vram_hits": vram_hits, "ram_hits": ram_hits, "disk_reads": disk_reads,
                 "hit_rate_vram": p_vram, "hit_rate_ram_or_vram": p_any, "routed_bytes": routed,
                 "bytes_from_disk": disk_bytes, "bytes_over_pcie": pcie_bytes, "disk_s": t_disk, "pcie_s": t_pcie,
                 "compute_s": t_compute}
    bound_by = max((t_disk, "disk"), (t_pcie, "pcie"), (t_compute, "compute"))[1]
    tps = {
        "all_cold_disk": (hw.disk_gbps * GB) / routed,
        "all_cold_pcie": (hw.pcie_gbps * GB) / routed if gpu else None,
        "cpu_compute": (1.0 / t_compute) if t_compute > 0 else None,  # None: GPU path, or not measured
        "expected": (1.0 / t) if t > 0 else None,  # None: no transfers at all once warm
        "expected_bound_by": bound_by if t > 0 else "compute",
    }
    assumptions = [
        "uniform, independent routing: P(VRAM) = VRAM slots per layer / experts per layer; P(RAM or VRAM) = "
        "max(RAM, VRAM slots per layer) / experts per layer (inclusive tiers); learned pins do not help "
        "uniform routing",
        ("GPU path: transfer bounds: disk reads and PCIe copies overlap, so a token takes max(disk, PCIe) time; "
         "GPU compute and the dense core's reads (resident) are not counted" if gpu else
         "CPU path: disk reads overlap compute, so a token takes max(disk, compute) time; compute = routed experts "
         "x the measured time per expert (decode its record + SwiGLU) + the dense core's float32 weights (all but "
         "the embedding) / the measured matrix-vector rate; attention over the KV cache is not counted"
         + ("" if t_compute else " (no CPU rate given: compute not counted)")),
        f"reserves: {o.vram_reserve_gb:g} GB of VRAM (CUDA context, workspaces, activations), {o.ram_reserve_gb:g} "
        f"GB of RAM (OS, stage processes); expert slots are spread evenly over the {L} MoE layers",
        "GB = 1e9 bytes",
    ]
    if m.dense_bytes_all_quantized is not None:
        assumptions.append(f"dense core {_gb(m.dense_bytes)} as the converter writes it (norms, routers and indexer "
                           f"heads stay f32); {_gb(m.dense_bytes_all_quantized)} if every weight were "
                           f"{m.dense_format}")
    if not gpu and m.dense_params is not None:
        assumptions.append(f"CPU path: the numpy backend holds the dense core dequantised to float32 "
                           f"({_gb(dense_ram)} of RAM, whatever --dense the container has)")
    return Plan(ok=not problems, device="gpu" if gpu else "cpu", model=asdict(m) | {"routed_bytes": m.routed_bytes},
                hardware=asdict(hw), options=asdict(o), vram=vram, ram=ram, slots=slots, kv=kvd,
                per_token=per_token, tokens_per_s=tps, problems=problems, warnings=warnings, assumptions=assumptions,
                dense_fits=dense_fits)


def _cpu_dense_bytes(m: ModelSizes) -> int:
    """RAM the CPU path's dense core takes: the numpy backend dequantises every dense tensor to float32 once."""
    return 4 * m.dense_params if m.dense_params is not None else m.dense_bytes


def _cpu_compute_s(m: ModelSizes, hw: Hardware) -> float:
    """Seconds of numpy work per decoded token (0 when no CPU rate is given)."""
    if hw.cpu_expert_s is None:
        return 0.0
    dense = 4 * (m.dense_params_per_token or 0) / (hw.cpu_gemv_gbps * GB) if hw.cpu_gemv_gbps else 0.0
    return m.routed_per_token * hw.cpu_expert_s + dense


def _dense_advice(m: ModelSizes, fits: dict) -> str:
    """Which dense format fits the VRAM when the asked one does not (the most faithful first)."""
    if not fits:
        return ""
    ok = [f for f in DENSE_CHOICES if fits.get(f) is not None]
    if not ok:
        smallest = DENSE_CHOICES[-1]
        return (f". No dense format fits: even --dense {smallest} ({_gb(m.dense_bytes_by_format[smallest])}) leaves "
                f"no room for {2 * m.experts_per_token} expert slots")
    f = ok[0]
    return (f". The dense core fits at --dense {f} ({_gb(m.dense_bytes_by_format[f])}, leaving {fits[f]:,} expert "
            f"slots): convert with `coli convert SRC DST --dense {f}` (what it costs: docs/quantization.md)")
