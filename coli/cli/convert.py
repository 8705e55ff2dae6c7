"""`coli convert SRC DST`: a Hugging Face glm_moe_dsa checkpoint -> a ColiStream container (resumable)."""

from __future__ import annotations

from pathlib import Path

import typer

from coli.cli.common import LazyProgress, clean_errors, stderr_note

HELP = """Convert a Hugging Face glm_moe_dsa checkpoint directory (bf16/fp16/fp32, or FP8-e4m3 with 128x128 weight_scale_inv blocks; one file or shards + model.safetensors.index.json) into a ColiStream container.

\b
Formats (--experts for the routed experts, --dense for the rest):
  int4  symmetric 4-bit, one fp16 scale per --group inputs (4.25 bits/weight at g64)
  int8  symmetric 8-bit, one fp16 scale per row
  int2  2-bit, fp16 scale and offset per --group inputs
  bf16  bfloat16 (lossless for bf16 checkpoints)
  f32   float32 (lossless; for exact tests)
Norms, routers, the router correction bias and the indexer's weights_proj always stay float32. The MTP layer (layer num_hidden_layers, GLM-5's draft head for `coli run --mtp`) is kept when the checkpoint has a complete one: its experts as records of that layer, the rest in the dense core (--no-mtp leaves it out; from hf:// it is kept when the repo's index names all of it).

Interrupted (Ctrl-C, SIGKILL, power loss, full disk)? Run the same command again: it resumes and ends byte-identical to an uninterrupted run. Different options on an unfinished DST are refused.

SRC may be hf://ORG/REPO\\[@REVISION]: the checkpoint is fetched from the Hub shard by shard (huggingface_hub: HF_TOKEN or `hf auth login`, HF_ENDPOINT, HF_HUB_CACHE) and each shard is deleted once converted, so the disk holds the container plus at most --max-shards-on-disk shards. Killed? Rerun it: it resumes, byte-identical to converting a local copy.
"""


def convert(
    src: str = typer.Argument(..., help="Hugging Face checkpoint directory (config.json + safetensors), or "
                                        "hf://ORG/REPO\\[@REVISION] to download it shard by shard."),
    dst: Path = typer.Argument(..., help="Container directory to create (or an unfinished one to resume)."),
    experts: str = typer.Option("int4", "--experts", help="Routed expert format: int4 | int8 | int2 | bf16 | f32."),
    dense: str = typer.Option("int8", "--dense", help="Dense core format: int4 | int8 | int2 | bf16 | f32 (GLM-5 at "
                              "int8 needs a 22 GB GPU, at int4 16 GB: `coli plan` says which fits)."),
    group: int = typer.Option(64, "--group", help="Inputs per scale group for int4/int2: 32 | 64 | 128."),
    tile_kb: int = typer.Option(512, "--tile-kb", help="Tile size in KiB (whole rows per tile, each tile "
                                                       "dequantises on its own)."),
    expert_file_mb: int = typer.Option(16384, "--expert-file-mb", help="Largest expert store file in MiB "
                                                                       "(records are never split)."),
    threads: int = typer.Option(2, "--threads", min=1, help="Worker threads quantising expert records."),
    commit_mb: int = typer.Option(256, "--commit-mb", min=1, help="Journal finished work (fsync) at least every "
                                                                  "this many MiB written, and every 2 s: the most "
                                                                  "work a crash can cost."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Leave the MTP layer (the draft head) out of the container."),
    max_shards_on_disk: int = typer.Option(2, "--max-shards-on-disk", min=1,
                                           help="hf:// only: checkpoint shards kept on disk at once (each is "
                                                "deleted once converted)."),
) -> None:
    if src.startswith("hf://"):
        return _convert_hf(src, dst, experts, dense, group, tile_kb, expert_file_mb, threads, commit_mb,
                           no_progress, max_shards_on_disk, no_mtp)
    _convert(Path(src), dst, experts, dense, group, tile_kb, expert_file_mb, threads, commit_mb, no_progress, no_mtp)


@clean_errors
def _convert(src, dst, experts, dense, group, tile_kb, expert_file_mb, threads, commit_mb, no_progress, no_mtp=False):
    from coli.container.writer import ConvertOptions, convert as run_convert

    opts = ConvertOptions(experts=experts, dense=dense, group=group, tile_kb=tile_kb, expert_file_mb=expert_file_mb,
                          mtp=not no_mtp)
    opts.validate()
    if no_progress:
        result = run_convert(src, dst, opts, report=stderr_note, threads=threads, commit_bytes=commit_mb << 20)
    else:
        with LazyProgress("converting", eta=True) as bar:   # appears once the input has been checked
            result = run_convert(src, dst, opts, progress=bar.update, report=bar.print, threads=threads,
                                 commit_bytes=commit_mb << 20)
    if result.status == "already complete":
        stderr_note(f"{dst}: already a complete container made with these options; nothing to do")
        return
    m = result.manifest
    size = m.dense_file.size + sum(f.size for f in m.expert_files) if m else 0
    rate = result.bytes_in / result.seconds / 1e6 if result.seconds > 0 else 0.0
    resumed = f", resumed after {result.units_skipped} of {result.units_total} units" if result.units_skipped else ""
    stderr_note(f"{dst}: container complete ({opts.flags()}); {size / 1e9:.3f} GB; read {result.bytes_in / 1e9:.3f} GB "
                f"in {result.seconds:.1f} s ({rate:.0f} MB/s){resumed}")


# ---- hf://ORG/REPO[@REVISION]: shard by shard from the Hub (coli/hub/stream.py) ----
@clean_errors
def _convert_hf(src, dst, experts, dense, group, tile_kb, expert_file_mb, threads, commit_mb, no_progress, max_shards,
                no_mtp=False):
    from coli.container.writer import ConvertOptions
    from coli.hub.progress import transfer_bars
    from coli.hub.stream import convert_hf

    opts = ConvertOptions(experts=experts, dense=dense, group=group, tile_kb=tile_kb, expert_file_mb=expert_file_mb,
                          mtp=not no_mtp)
    opts.validate()
    with transfer_bars(not no_progress, ("downloading", "bytes"), ("converting", "units")) as (note, dl, cv):
        r = convert_hf(src, dst, opts, max_shards=max_shards, threads=threads, report=note, on_download=dl,
                       on_convert=cv, commit_bytes=commit_mb << 20)
    if r.status == "already complete":
        stderr_note(f"{dst}: already a complete container made with these options; nothing to do")
        return
    m = r.manifest
    size = m.dense_file.size + sum(f.size for f in m.expert_files) if m else 0
    resumed = f", resumed after {r.units_skipped} of {r.units_total} units" if r.units_skipped else ""
    stderr_note(f"{dst}: container complete ({opts.flags()}); {size / 1e9:.3f} GB; downloaded {r.shards_fetched} "
                f"shard(s), {r.bytes_downloaded / 1e9:.3f} GB, in {r.seconds:.1f} s{resumed}")


def register(app: typer.Typer) -> None:
    app.command("convert", help=HELP)(convert)
