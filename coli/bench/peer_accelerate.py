"""The peer `coli bench` compares against: transformers' GlmMoeDsaForCausalLM with accelerate's big-model
offloading, over a slice's config (same L layers, GLM-5 dims, bf16), capped at the same VRAM budget.

    run_peer(slice_dir, vram_gb, tokens, prompt_len=8, device="cuda") -> dict
    python -m coli.bench.peer_accelerate SLICE --vram-gb 16 --tokens 8 [--prompt-len 8] [--device cuda] --json OUT

Run it in a subprocess of its own: it must not share a process with PyCUDA (two CUDA stacks, one context each).

What it does:
  * The model is built from the slice's config.json on the meta device (parameters only; buffers such as rope's
    inv_freq are computed normally), then every parameter is materialised on the CPU in bf16 and filled fast:
    a 16 Mi-element random block (std ~0.02) copied over the tensor in chunks, norm weights 1, the router's
    correction bias 0. RANDOM WEIGHTS, not the slice's: bytes moved per token depend only on the shapes and the
    device map, and the slice's routing is not replayed (the peer's router picks its own experts; with
    transformers' expert layout a layer's whole expert tensor moves whichever experts are picked).
  * device "cuda": accelerate's `infer_auto_device_map(max_memory={0: "<vram_gb>GiB", "cpu": ...},
    no_split_module_classes=["GlmMoeDsaDecoderLayer"])` and `dispatch_model`: modules mapped to "cpu" are
    offloaded, i.e. their weights are copied to the GPU on every forward. Bytes moved H2D per token = the bytes of
    the parameters of the offloaded modules, read from the device map, times how often each
    offloaded module ran per decode step (counted by forward hooks: 1 each, checked, not assumed).
    infer_auto_device_map keeps room on the GPU for the largest no-split module; a GLM-5 decoder layer in bf16
    is ~19.8 GB, so a budget below that puts every layer on "cpu", and the layer being run still occupies the
    GPU while it runs: `peak_vram_gb` (torch.cuda.max_memory_allocated) says what was really used.
  * device "cpu": no offload (bytes moved = 0), no accelerate needed; the tests use it.
  * Greedy decode: a prefill of `prompt_len` random token ids (which yields the first new token), then `tokens`
    decode steps with past_key_values, each timed between torch.cuda.synchronize calls (prefill and decode
    separately); "generated" holds the tokens + 1 new ids.

A failure inside transformers or accelerate (a kernel the model needs, out of memory) is returned as
{"error": "...", "stage": ...} -- never a figure that was not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

FILL_BLOCK = 16 << 20          # elements of the random block copied over each parameter
FILL_STD = 0.02
_SKIP_CFG = ("model_type", "architectures", "coli_bench_slice")


def hf_config(slice_dir: str | Path):
    """transformers' GlmMoeDsaConfig from the slice's config.json (the extra keys of coli's dump dropped)."""
    from transformers import GlmMoeDsaConfig

    raw = json.loads((Path(slice_dir) / "config.json").read_text())
    cfg = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in _SKIP_CFG})
    return cfg


def _build_on_meta(cfg):
    """The model with every parameter on the meta device (buffers real), like accelerate's
    init_empty_weights(include_buffers=False), without needing accelerate."""
    import torch
    from torch import nn
    from transformers import GlmMoeDsaForCausalLM

    orig = nn.Module.register_parameter

    def register_on_meta(self, name, param):
        orig(self, name, param)
        if param is not None:
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta
    try:
        model = GlmMoeDsaForCausalLM(cfg)
    finally:
        nn.Module.register_parameter = orig
    return model


def _materialise(model, dtype) -> int:
    """Every meta parameter made real on the CPU and filled fast; returns the bytes materialised."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    block = (torch.rand(FILL_BLOCK, generator=g) * 2 - 1).mul_(FILL_STD * 3 ** 0.5)   # uniform, std FILL_STD
    blocks: dict[torch.dtype, torch.Tensor] = {}
    total = 0
    keep_f32 = set(getattr(model, "_keep_in_fp32_modules", None) or []) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            dt = torch.float32 if any(k in full for k in keep_f32) else dtype
            t = torch.empty(p.shape, dtype=dt)
            if pname == "e_score_correction_bias" or (t.ndim == 1 and pname == "bias"):
                t.zero_()
            elif t.ndim == 1:
                t.fill_(1.0)                                    # norm weights
            else:
                src = blocks.setdefault(dt, block.to(dt))
                flat = t.view(-1)
                for i in range(0, flat.numel(), FILL_BLOCK):
                    n = min(FILL_BLOCK, flat.numel() - i)
                    flat[i:i + n].copy_(src[:n])
            mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
            total += t.numel() * t.element_size()
    return total


def _module_bytes(mod) -> int:
    """Parameter bytes (accelerate offloads parameters; buffers go to the GPU once, offload_buffers=False)."""
    return sum(t.numel() * t.element_size() for t in mod.parameters())


def _placement_units(model) -> list[str]:
    """The modules a device map places, in forward order: the embedding, each layer's children (its MLP's
    children separately, so a layer's routed experts can live on the CPU while its attention, router and shared
    expert stay on the GPU), the final norm, rotary embedding and lm_head. A module holding parameters of its
    own is placed whole."""
    units = []
    inner = model.model
    for n, m in inner.named_children():
        if n != "layers":
            units.append(f"model.{n}")
            continue
        for i, layer in enumerate(m):
            base = f"model.layers.{i}"
            if any(True for _ in layer.named_parameters(recurse=False)):
                units.append(base)
                continue
            for cn, child in layer.named_children():
                if cn == "mlp" and not any(True for _ in child.named_parameters(recurse=False)):
                    units += [f"{base}.mlp.{gn}" for gn, _ in child.named_children()]
                else:
                    units.append(f"{base}.{cn}")
    units.append("lm_head")
    return units


def _dispatch(model, vram_gb: float, cpu_gb: float | None) -> tuple[dict[str, Any], dict[str, int]]:
    """A device map under the budget, then accelerate's dispatch; returns (device_map, bytes per offloaded module).

    Why not infer_auto_device_map: it reserves room on the GPU for the largest module it may have to stream
    (accelerate's offload buffer), and one GLM-5 layer's routed experts (19 GB in bf16) exceed a 16 GiB budget,
    so it maps *everything* to "cpu" -- and dispatch_model then runs the whole model on the CPU. Here the units
    (see _placement_units) fill the GPU in forward order up to 90 % of the budget; the rest goes to "cpu" and
    accelerate streams it to the GPU on every forward (its CPU-offload hooks) -- the peer's normal way to run
    a model larger than the GPU."""
    from accelerate import dispatch_model

    budget = vram_gb * 2 ** 30 * 0.9
    used = 0
    dmap: dict[str, Any] = {}
    for name in _placement_units(model):
        b = _module_bytes(model.get_submodule(name))
        if used + b <= budget:
            dmap[name] = 0
            used += b
        else:
            dmap[name] = "cpu"
    offloaded = {name: _module_bytes(model.get_submodule(name)) for name, dev in dmap.items() if dev == "cpu"}
    if cpu_gb is not None and sum(offloaded.values()) > cpu_gb * 2 ** 30:
        raise RuntimeError(f"the offloaded modules need {sum(offloaded.values()) / 2**30:.1f} GiB of RAM, "
                           f"more than --cpu-gb {cpu_gb}")
    dispatch_model(model, device_map=dmap, main_device=0)
    return dmap, offloaded


def run_peer(slice_dir: str | Path, vram_gb: float, tokens: int, prompt_len: int = 8, device: str = "cuda",
             cpu_gb: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Greedy decode of `tokens` tokens after a `prompt_len` prompt on the accelerate-offloaded peer.

    Returns {"peer", "device", "vram_gb", "layers", "tokens", "prompt_len", "weights", "setup_s", "build_s",
    "materialise_s", "dispatch_s", "param_bytes", "prefill_s", "decode_s", "decode_step_s", "tokens_per_s",
    "h2d_bytes_per_token", "h2d_bytes_basis", "offloaded_modules", "offloaded_forwards_per_token",
    "device_map_summary", "peak_vram_gb", "generated", "versions"} or, on a failure,
    {"error", "stage", "peer", "device", ...what was known by then}."""
    slice_dir = Path(slice_dir)
    out: dict[str, Any] = {"peer": "transformers GlmMoeDsaForCausalLM + accelerate offload (random bf16 weights)",
                           "device": device, "vram_gb": vram_gb, "tokens": tokens, "prompt_len": prompt_len,
                           "slice": str(slice_dir)}
    if tokens < 1 or prompt_len < 1:
        return {**out, "error": f"tokens={tokens}, prompt_len={prompt_len}: both must be >= 1", "stage": "options"}
    if device not in ("cuda", "cpu"):
        return {**out, "error": f"device {device!r}: 'cuda' or 'cpu'", "stage": "options"}
    stage = "import"
    try:
        import torch
        import transformers

        out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        if device == "cuda":
            import accelerate
            out["versions"]["accelerate"] = accelerate.__version__
            if not torch.cuda.is_available():
                return {**out, "error": "torch sees no CUDA device", "stage": "import"}
        torch.manual_seed(seed)

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        stage = "config"
        cfg = hf_config(slice_dir)
        cfg._attn_implementation = "eager"
        out["layers"] = cfg.num_hidden_layers
        t0 = time.perf_counter()
        stage = "build"
        model = _build_on_meta(cfg)
        t1 = time.perf_counter()
        stage = "materialise"
        out["param_bytes"] = _materialise(model, torch.bfloat16)
        model.eval()
        t2 = time.perf_counter()
        out["weights"] = ("random (uniform, std ~0.02, one 16 Mi-element block repeated; norms 1, biases 0): bytes "
                          "moved depend only on shapes; routing is the peer's own")
        stage = "dispatch"
        offloaded: dict[str, int] = {}
        if device == "cuda":
            dmap, offloaded = _dispatch(model, vram_gb, cpu_gb)
            torch.cuda.reset_peak_memory_stats()
        else:
            dmap = {"": "cpu"}
        t3 = time.perf_counter()
        out.update(build_s=t1 - t0, materialise_s=t2 - t1, dispatch_s=t3 - t2, setup_s=t3 - t0)
        summary: dict[str, int] = {}
        for v in dmap.values():
            summary[str(v)] = summary.get(str(v), 0) + 1
        out["device_map_summary"] = summary
        out["offloaded_modules"] = offloaded

        calls = {name: 0 for name in offloaded}
        hooks = [(model.get_submodule(name) if name else model).register_forward_pre_hook(
            lambda m, a, name=name: calls.__setitem__(name, calls[name] + 1)) for name in offloaded]

        stage = "prefill"
        first = next(model.parameters()).device if device == "cpu" else torch.device("cuda", 0)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, cfg.vocab_size, (1, prompt_len), generator=g).to(first)
        generated: list[int] = []
        with torch.no_grad():
            sync()
            ts = time.perf_counter()
            res = model(input_ids=ids, use_cache=True)
            past = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            out["prefill_s"] = time.perf_counter() - ts
            generated.append(int(nxt.item()))
            for c in calls:
                calls[c] = 0
            stage = "decode"
            steps = []
            for _ in range(tokens):
                sync()
                ts = time.perf_counter()
                res = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                generated.append(int(nxt.item()))
                sync()
                steps.append(time.perf_counter() - ts)
        for h in hooks:
            h.remove()
        out["generated"] = generated
        out["decode_step_s"] = steps
        out["decode_s"] = sum(steps)
        out["tokens_per_s"] = len(steps) / sum(steps)
        per_tok = {n: c / len(steps) for n, c in calls.items()}
        out["offloaded_forwards_per_token"] = per_tok
        out["h2d_bytes_per_token"] = int(sum(offloaded[n] * per_tok[n] for n in offloaded))
        out["h2d_bytes_basis"] = ("parameters of modules the device map puts on 'cpu' x their forward calls "
                                  "per decode step" if device == "cuda" else "no offload on device 'cpu'")
        out["peak_vram_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
        return out
    except Exception as e:   # a kernel the model needs, OOM, an accelerate refusal: say so, never a figure
        return {**out, "error": f"{type(e).__name__}: {e}", "stage": stage,
                "traceback": traceback.format_exc(limit=8)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coli.bench.peer_accelerate",
                                 description="transformers + accelerate offload peer over a bench slice's config")
    ap.add_argument("slice", help="slice directory (coli bench make-slice)")
    ap.add_argument("--vram-gb", type=float, default=16.0)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cpu-gb", type=float, default=None, help="accelerate's cpu budget (default 90%% of RAM)")
    ap.add_argument("--json", dest="json_out", default=None, help="write the result here (else stdout)")
    a = ap.parse_args(argv)
    r = run_peer(a.slice, a.vram_gb, a.tokens, a.prompt_len, a.device, a.cpu_gb)
    text = json.dumps(r, indent=1, default=str)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    else:
        print(text)
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main())
