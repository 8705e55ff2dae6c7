"""`coli bench`: benchmarks on GLM-5-shaped slices. `make-slice` writes one; `stream` times the GPU engine's
streaming scenarios over it (coli.bench.stream, docs/performance.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors, stderr_note

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks on GLM-5-shaped slices (docs/performance.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

MAKE_SLICE_HELP = """Write a GLM-5-shaped slice: a ColiStream container with GLM-5's real dimensions (hidden 6144, 256 experts of 3 x 2048 x 6144, top-8, the real MLA/indexer shapes, a shared expert) and random weights, for L MoE layers (first_k_dense_replace = 0).

Every expert record has the real size (20,054,016 B at int4 g64), so a layer's experts weigh 5.13 GB; the dense core adds about 2 GB at int8 (`coli convert`'s default, --dense-format) with the real vocabulary (--vocab shrinks it). The size is printed and the free space checked before anything is written.

The slice stores its routing (--trace) as DIR/bench_trace.trace, a routing trace in the coli.trace format; coli.bench.trace_router.TraceRouting makes a model route by it. The container passes coli verify and opens with ContainerReader like a converted one. It is written to DIR.tmp and renamed to DIR once complete.
"""


@bench_app.command("make-slice", help=MAKE_SLICE_HELP)
def make_slice(
    dir: Path = typer.Argument(..., help="Container directory to create (must not exist or be empty, unless "
                                         "--force)."),
    layers: int = typer.Option(2, "--layers", "-l", help="MoE layers in the slice (1..255); ~5.13 GB each at int4 "
                                                         "g64."),
    experts: Optional[int] = typer.Option(None, "--experts", help="Routed experts per layer (default: the "
                                                                  "preset's, 256 for glm5)."),
    fmt: str = typer.Option("int4", "--format", help="Routed expert format: int4 | int8 | int2 | bf16 | f32."),
    group: int = typer.Option(64, "--group", help="Inputs per scale group for int4/int2: 32 | 64 | 128."),
    dense_fmt: str = typer.Option("int8", "--dense-format",
                                  help="Dense core format: int4 | int8 | int2 | bf16 | f32; the default is `coli "
                                       "convert --dense`'s, so the slice's dense layer reads what a converted "
                                       "model's does (norms, routers, biases and the indexer's weights_proj stay "
                                       "f32)."),
    trace: str = typer.Option("glm52", "--trace", help="Routing to store: uniform | glm52 (synthetic, "
                                                       "coli.traces_synth) | FILE (a recorded routing trace, "
                                                       "mapped onto the slice's layers)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Tokens of the stored trace (default 256 for "
                                                                "uniform/glm52, every token of FILE)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the weights and the synthetic trace (same options, "
                                                      "same bytes)."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Shrink the vocabulary to N (default: the real "
                                                              "one, 154880 for glm5); recorded in the manifest "
                                                              "and config.json."),
    tile_kb: int = typer.Option(512, "--tile-kb", help="Tile size in KiB, as coli convert."),
    preset: str = typer.Option("glm5", "--preset", help="Dimensions: glm5 (the real model) | tiny (the test "
                                                        "model; a slice in milliseconds)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty DIR (removed only once the new slice "
                                                      "is complete)."),
    threads: int = typer.Option(2, "--threads", min=1, help="Worker threads making records."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    _make_slice(dir, layers, experts, fmt, group, dense_fmt, trace, tokens, seed, vocab, tile_kb, preset, force,
                threads, no_progress)


@clean_errors
def _make_slice(dir, layers, experts, fmt, group, dense_fmt, trace, tokens, seed, vocab, tile_kb, preset, force,
                threads, no_progress):
    from coli.bench.slice import SliceOptions, check_destination, human_bytes, plan_slice, write_slice

    opts = SliceOptions(layers=layers, experts=experts, fmt=fmt, group=group, dense_fmt=dense_fmt, tile_kb=tile_kb,
                        trace=trace, tokens=tokens, seed=seed, vocab=vocab, preset=preset)
    sp = plan_slice(opts)
    stderr_note(sp.describe())
    check_destination(dir, force, sp)
    if no_progress:
        result = write_slice(dir, sp, force=force, report=stderr_note, threads=threads)
    else:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)
        console = Console(stderr=True)
        with Progress(TextColumn("writing slice"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task("slice", total=sp.total_bytes)
            result = write_slice(dir, sp, force=force, report=lambda m: console.print(m), threads=threads,
                                 progress=lambda d, t: bar.update(task, completed=d, total=t))
    meta = sp.trace_meta
    stderr_note(f"{result.dir}: slice complete, {human_bytes(result.bytes)} in {result.seconds:.1f} s "
                f"({human_bytes(result.bytes / max(result.seconds, 1e-9))}/s); routing trace {meta['trace']} "
                f"({meta['tokens']} tokens) in {result.dir / 'bench_trace.trace'}")


STREAM_HELP = """Decode N tokens over a slice (routing replayed from its stored trace) in streaming scenarios and report per-MoE-layer time, effective H2D and NVMe GB/s over the peaks measured in the same run, overlap efficiency, hit rates, CPU fallbacks and demand delay.

Scenarios: warm (every expert in VRAM), cold-ram (every expert in pinned RAM, VRAM retention off), mapped (row mapped-ram: the same pinned RAM read by the MoE kernels over PCIe, zero-copy, the step replayed as in warm; its tokens checked against warm's), disk (O_DIRECT reads, no RAM cache), budget (--vram-gb/--ram-gb scaled to the full model's per-layer capacities; run with an oracle pilot and without), sync (baseline: whole-record synchronous copies, then compute), peer (baseline: coli.bench.peer_accelerate in a subprocess), or all.

tokens/s are EXTRAPOLATED to GLM-5 (75 MoE + 3 dense layers), per-layer cache capacities scaled to what the full model would have under the same budgets. Needs a CUDA GPU.

--batch 1,4,8,16: warm and cold-ram also decode B sequences together (one batched step over their rows, the union of their experts asked once per layer), each its own stretch of the trace; rows of aggregate and per-sequence tokens/s and expert bytes per token, against B = 1 of the same run.

--verify 2,3,4: warm and cold-ram also time MTP's verify step of S = k+1 positions of one sequence (routing from consecutive trace tokens: the real adjacent-token expert union) against the one-token step, and what k drafts would give at acceptance 0.6 / 0.8 / 0.9 (the slice's random weights cannot accept drafts: the acceptance is a parameter), the break-even acceptance and what --mtp auto would choose at --mtp-acceptance.

--prefill 512,2048,8192: cold-ram and each budget-nospec engine (warm too, as the compute reference) time a prefill of S prompt tokens (one forward over a fresh cache, rows on consecutive trace tokens), extrapolated to GLM-5's time to first token, beside the time to copy every GLM-5 expert once at this run's H2D peak, the expert bytes the prefill copied and the MoE's compute time. S is at most 8192 (a slice's 8,192-token prefill holds ~7 GB of activations); each S is timed once, and the rows add about a minute to a warm,cold-ram,budget run.
"""


@bench_app.command("stream", help=STREAM_HELP)
def stream(
    dir: Path = typer.Argument(..., help="A slice written by coli bench make-slice."),
    scenario: str = typer.Option("all", "--scenario", help="Comma list of warm, cold-ram, mapped, disk, budget, "
                                                           "spec, sync, peer; or all."),
    tokens: int = typer.Option(16, "--tokens", min=1, help="Timed decode tokens per scenario (after 2 warm-up)."),
    vram_gb: str = typer.Option("16", "--vram-gb", help="VRAM budget(s) in GB the capacities are scaled from: one, "
                                                        "or a comma list (16,24,32) to run the budget scenario once "
                                                        "per budget; the first is the peer's and the other "
                                                        "scenarios' budget."),
    ram_gb: float = typer.Option(64.0, "--ram-gb", help="RAM budget the RAM-tier capacity is scaled from."),
    tile_kb: int = typer.Option(1024, "--tile-kb", min=4, help="H2D copy tile in KiB."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Write the full result as JSON here."),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Write plots (PNG) into this directory."),
    batch: str = typer.Option("1", "--batch", help="Concurrent sequences, a comma list (1,4,8,16): warm and "
                                                   "cold-ram also decode B sequences together on their engine "
                                                   "for each B (aggregate tok/s, experts per step, bytes per "
                                                   "token, x B=1); 1: their single-sequence rows only."),
    verify: str = typer.Option("1", "--verify", help="MTP verify-step sizes in positions, a comma list (2,3,4 = "
                                                     "k = 1..3 drafts + 1): warm and cold-ram also time them against "
                                                     "the one-token step (always run) and the tok/s MTP would give; "
                                                     "1: not run."),
    mtp_acceptance: str = typer.Option("0.8", "--mtp-acceptance", help="With --verify: the first-draft acceptance "
                                                                       "--mtp auto's rule is judged at (the demo "
                                                                       "model's measured figure; the slice cannot "
                                                                       "accept drafts)."),
    prefill: str = typer.Option("", "--prefill", help="Prompt lengths in tokens, a comma list (512,2048,8192; at "
                                                      "most 8192): time-to-first-token rows on the cold-ram and "
                                                      "budget engines (warm: the compute reference); empty: not run."),
    prefill_ahead: bool = typer.Option(False, "--prefill-ahead", help="With --prefill: the cold-ram prefills also "
                                                                      "with the next MoE layer's experts copied ahead "
                                                                      "on the speculative lane (same slots, and two "
                                                                      "layers' worth), against the same without."),
) -> None:
    _stream(dir, scenario, tokens, vram_gb, ram_gb, tile_kb, json_out, plots, batch, verify, mtp_acceptance, prefill,
            prefill_ahead)


@clean_errors
def _stream(dir, scenario, tokens, vram_gb, ram_gb, tile_kb, json_out, plots, batch="1", verify="1",
            mtp_acceptance="0.8", prefill="", prefill_ahead=False):
    from coli.bench.batch_decode import check_batches, parse_batches
    from coli.bench.budget import parse_budgets
    from coli.bench.stream import parse_scenarios, run_scenarios
    from coli.bench.verify_step import check_verify, parse_acceptance, parse_verify
    from coli.bench.prefill import check_prefill, parse_prefill
    from coli.errors import ColiError
    names = parse_scenarios(scenario)
    vram_gb = parse_budgets(vram_gb)          # a bad list is refused before the GPU is touched
    batches = parse_batches(batch)
    sizes = parse_verify(verify)
    acceptance = parse_acceptance(mtp_acceptance)
    prompts = parse_prefill(prefill)
    check_prefill(prompts, names)
    if prefill_ahead and not (prompts and "cold-ram" in names):
        raise ColiError("--prefill-ahead: its rows are cold-ram prefills: give --prefill and the cold-ram scenario")
    if not Path(dir).is_dir():
        raise ColiError(f"{dir}: no such slice directory (write one with coli bench make-slice)")
    if batches != [1]:
        from coli.bench.trace_router import TraceRouting
        check_batches(batches, names, TraceRouting(dir).n_tokens)
    if sizes != [1]:
        from coli.bench.trace_router import TraceRouting
        check_verify(sizes, names, TraceRouting(dir).n_tokens)
    try:
        from coli.gpu.cuda_runtime import CudaUnavailable, get_runtime
        get_runtime(0)
    except CudaUnavailable as e:
        raise ColiError(f"coli bench stream needs a CUDA GPU: {e}") from None
    except ImportError as e:
        raise ColiError(f"coli bench stream needs a CUDA GPU: PyCUDA is not importable ({e})") from None
    if plots is not None:
        from coli.bench.plots import missing
        why = missing()
        if why:   # say it before minutes of benchmark, not after; the numbers are still worth having
            stderr_note(f"--plots {plots}: {why}; the benchmark runs without them")
    run_scenarios(dir, names, tokens=tokens, vram_gb=vram_gb, ram_gb=ram_gb, tile_kb=tile_kb, out_json=json_out,
                  plots_dir=plots, peer="peer" in names, report=stderr_note, batches=batches, verify=sizes,
                  mtp_acceptance=acceptance, prefill=prompts, prefill_ahead=prefill_ahead)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
