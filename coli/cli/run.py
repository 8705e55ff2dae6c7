"""`coli run`: in-process generation (no stage processes), the simplest way to run a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors, parse_ids, require_device, sampling_from_options, stderr_note
from coli.errors import ColiError


def run(
    model: Path = typer.Option(..., "--model", "-m", help="Hugging Face checkpoint directory or ColiStream container."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (needs tokenizer.json in the model directory)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Comma-separated token ids, used exactly as given."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=0, help="Tokens to generate at most."),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most likely token (default when no sampling option is given)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="Sampling temperature (> 0)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample among the k most likely tokens (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    device: str = typer.Option("cpu", "--device", help="cpu (numpy) | gpu | auto."),
    vram_gb: Optional[float] = typer.Option(None, "--vram-gb", min=0.0, help="GPU: stream routed experts through a VRAM "
                                            "cache sized from this budget (default: every expert resident)."),
    vram_slots: Optional[int] = typer.Option(None, "--vram-slots", min=1, help="GPU: exactly this many VRAM expert slots."),
    vram_policy: str = typer.Option("freq", "--vram-policy", help="VRAM slot replacement: freq | lru | rdf | lfu."),
    stream_tile_kb: int = typer.Option(1024, "--stream-tile-kb", min=4, help="GPU: tile of the speculative copy lane in KiB (a demand waits behind at most one)."),
    max_context: int = typer.Option(4096, "--max-context", min=16, help="KV positions the VRAM budget reserves."),
    record_routing: Optional[Path] = typer.Option(None, "--record-routing", metavar="FILE",
                                                  help="Append every MoE routing decision to this trace file (docs/traces.md)."),
    topp: Optional[float] = typer.Option(None, "--topp", "--expert-topp", min=0.0, max=1.0, metavar="P",
                                         help="APPROXIMATE: per token and layer keep only the fewest routed experts "
                                              "carrying routing weight share >= P (not --top-p sampling). Off = exact."),
    mtp: str = typer.Option("off", "--mtp", metavar="off|on|N|auto",
                            help="Speculative decoding with the model's MTP draft head: on = 1 draft per step, N = 1..3 "
                                 "chained drafts, auto = draft only while the measured step times say it pays. "
                                 "Lossless: the same tokens (greedy) or the same distribution (sampling)."),
) -> None:
    """Generate from a model in this process and print the result."""
    from coli.loader import GpuOptions
    gpu = GpuOptions(vram_gb=vram_gb, vram_slots=vram_slots, max_context=max_context, policy=vram_policy,
                     tile_kb=stream_tile_kb)
    _run(model, prompt, prompt_ids, max_tokens, greedy, temperature, top_p, top_k, seed, ignore_eos, as_json, device,
         record_routing, topp, gpu, mtp)


@clean_errors
def _run(model, prompt, prompt_ids, max_tokens, greedy, temperature, top_p, top_k, seed, ignore_eos, as_json, device,
         record_routing=None, topp=None, gpu=None, mtp="off"):
    from coli.model.mtp import load_mtp_head, parse_mtp

    from coli.generate import ContextTooLong, Generation, context_problem
    from coli.loader import load_model
    from coli.model_store import check_model_dir
    from coli.tokenizer import StreamDecoder, load_tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise ColiError("give exactly one of --prompt or --prompt-ids")
    params = sampling_from_options(greedy, temperature, top_p, top_k, seed)
    drafts = parse_mtp(mtp)      # a bad --mtp is refused before the model loads
    model = check_model_dir(model, names=True)   # a missing or half-converted --model is said as such, not as "no tokenizer.json"
    require_device(device)

    tok = load_tokenizer(model)
    if prompt is not None:
        if tok is None:
            raise ColiError(f"--prompt needs a tokenizer, and {model} has no tokenizer.json (use --prompt-ids)")
        ids = tok.encode(prompt)
        if not ids:
            raise ColiError("the prompt encodes to no tokens")
    else:
        ids = parse_ids(prompt_ids)
    lm, config = load_model(model, device, report=stderr_note, gpu=gpu)
    bad = [i for i in ids if i >= config.vocab_size]
    if bad:
        raise ColiError(f"prompt token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")
    problem = context_problem(len(ids), max_tokens, config.max_position_embeddings)
    if problem:
        raise ContextTooLong(problem)

    if topp is not None:
        if topp <= 0.0:
            raise ColiError("--topp must be in (0, 1]")
        lm.topp = topp
        stderr_note(f"[approximate: expert top-p {topp} drops low-weight routed experts; output differs from the exact model]")
    recorder = None
    if record_routing is not None:
        from coli.trace import RoutingRecorder
        recorder = RoutingRecorder.for_model(record_routing, config, meta={"model": str(model), "topp": topp})
        recorder.new_sequence()
        lm.routing_hook = recorder

    spec = (load_mtp_head(lm), drafts) if drafts is not None else None
    gen = Generation(lm, ids, max_tokens, params, eos_ids=config.eos_token_ids, ignore_eos=ignore_eos, mtp=spec)
    tokens: list[int] = []
    stream = StreamDecoder(tok) if (tok is not None and not as_json) else None
    try:
        for t in gen:
            tokens.append(t)
            if stream is not None:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()
    finally:
        if recorder is not None:
            recorder.close()
    vstats = None
    if hasattr(lm.experts, "snapshot"):      # the VRAM expert cache: land every copy, read its counters
        lm.experts.finish()
        vstats = lm.experts.snapshot()
        lm.experts.close()
    if as_json:
        out = {"tokens": tokens, "finish_reason": gen.stats.finish_reason, "prompt_tokens": len(ids),
               "stats": gen.stats.to_dict()}
        if topp is not None:
            out["approximate"] = {"expert_topp": topp}
        if vstats is not None:
            out["vram"] = vstats
            if getattr(lm.experts, "mtp_mode", None) is not None and spec is not None:
                out["vram"]["mtp_experts"] = lm.experts.mtp_mode     # where the MTP layer's experts lived
        if tok is not None:
            out["text"] = tok.decode(tokens)
        print(json.dumps(out))
    elif stream is not None:
        sys.stdout.write(stream.flush() + "\n")
    else:
        print(" ".join(str(t) for t in tokens))
    if not as_json:
        s = gen.stats
        stderr_note(f"[{s.new_tokens} tokens, finish: {s.finish_reason}, prefill {s.prefill_s:.3f} s, "
                    f"decode {s.decode_tps:.1f} tok/s]")
        if s.mtp is not None:
            acc = ", ".join("-" if a is None else f"{100 * a:.0f}%" for a in s.mtp["acceptance_per_position"])
            stderr_note(f"[MTP {mtp}: {s.mtp['tokens_per_step']:.2f} tokens per step, acceptance per draft position "
                        f"{acc}, {s.mtp['plain_rounds']} of {s.mtp['rounds']} steps without drafts]")
        if vstats is not None:
            stderr_note(f"[VRAM cache: {vstats['hits']} hits, {vstats['misses']} misses, {vstats['evictions']} evictions, "
                        f"{vstats['cpu_fallbacks']} CPU fallbacks, copy lane busy {100 * vstats['copy_busy']:.0f}%"
                        + (f", {vstats['ahead_layers']} layers copied ahead" if vstats.get("ahead_layers") else "")
                        + "]")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
