"""`--gpus 0,1 | auto` and per-GPU figures (`--vram-gb 16,24`, `--pcie-gbps 55,25`): parsing only (pure, no CUDA,
no nvidia-smi). The one helper every command with `--gpus` uses, so they all accept and refuse the same text.

    parse_gpus("0,1")  -> (0, 1)        parse_gpus("auto") -> AUTO (resolved at run time by resolve_gpus)
    resolve_gpus(AUTO, visible=[0, 1, 2]) -> (0, 1, 2)
    per_gpu("16", 2, "--vram-gb") -> (16.0, 16.0)      per_gpu("16,24", 2, "--vram-gb") -> (16.0, 24.0)

Indices are CUDA ordinals as `nvidia-smi` numbers them; `visible_gpus` narrows them by CUDA_VISIBLE_DEVICES the
way the CUDA runtime does (a list of integers; the first entry that is not a valid index ends the list)."""

from __future__ import annotations

import math
from typing import Sequence

from coli.errors import ColiError

AUTO = "auto"


def parse_gpus(text: str) -> tuple[int, ...] | str:
    """`--gpus` text -> GPU indices in the order given, or AUTO. Refuses empty items, non-integers, negative
    indices and repeats, naming the item."""
    t = (text or "").strip()
    if t.lower() == AUTO:
        return AUTO
    if not t:
        raise ColiError("--gpus is empty: give GPU indices (e.g. --gpus 0,1) or --gpus auto")
    out: list[int] = []
    for item in t.split(","):
        s = item.strip()
        if s.lower() == AUTO:
            raise ColiError(f"--gpus {text!r}: 'auto' stands alone (every visible GPU); do not mix it with indices")
        if not s.isdigit():
            raise ColiError(f"--gpus {text!r}: {s!r} is not a GPU index (give indices like 0,1 or auto)")
        i = int(s)
        if i in out:
            raise ColiError(f"--gpus {text!r}: GPU {i} is listed twice (each GPU holds one share of the model)")
        out.append(i)
    return tuple(out)


def visible_gpus(smi_indices: Sequence[int], cuda_visible_devices: str | None) -> tuple[int, ...]:
    """The GPUs a process can use: nvidia-smi's indices, narrowed and reordered by CUDA_VISIBLE_DEVICES when set.
    UUID entries are not resolved here (nvidia-smi would be needed): they are refused with what to set."""
    if cuda_visible_devices is None:
        return tuple(smi_indices)
    out: list[int] = []
    for item in cuda_visible_devices.split(","):
        s = item.strip()
        if s.startswith(("GPU-", "MIG-")):
            raise ColiError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names GPUs by UUID; --gpus auto reads "
                            f"indices only: set it to indices (e.g. 0,1) or pass --gpus 0,1")
        if not s.lstrip("-").isdigit() or int(s) < 0 or int(s) not in smi_indices or int(s) in out:
            break  # as the CUDA runtime does: the list ends at the first invalid entry
        out.append(int(s))
    return tuple(out)


def resolve_gpus(spec: tuple[int, ...] | str, visible: Sequence[int], why_none: str | None = None) -> tuple[int, ...]:
    """`parse_gpus`'s result -> concrete indices: AUTO becomes every visible GPU; named indices must be visible."""
    if spec == AUTO:
        if not visible:
            raise ColiError("--gpus auto: no GPU is visible" + (f" ({why_none})" if why_none else "")
                            + "; name the GPUs (--gpus 0,1) and give their memory (--vram-gb 16,16)")
        return tuple(visible)
    missing = [i for i in spec if i not in visible]
    if missing:
        seen = ", ".join(map(str, visible)) if visible else "none" + (f" ({why_none})" if why_none else "")
        raise ColiError(f"--gpus: GPU {missing[0]} is not visible (visible GPUs: {seen}); pick from those, or give "
                        f"--vram-gb and --pcie-gbps for every GPU to plan for another machine")
    return tuple(spec)


def parse_numbers(text: str, option: str, minimum_exclusive: float | None = 0.0,
                  minimum: float | None = None) -> tuple[float, ...]:
    """`16` or `16,24` -> (16.0,) or (16.0, 24.0); each finite and above the bound, naming the bad item."""
    items = [s.strip() for s in str(text).split(",")]
    out: list[float] = []
    for s in items:
        try:
            v = float(s)
        except ValueError:
            raise ColiError(f"{option} {text!r}: {s!r} is not a number (give one value, or one per GPU: 16,24)") from None
        if not math.isfinite(v) or (minimum_exclusive is not None and v <= minimum_exclusive) or \
                (minimum is not None and v < minimum):
            bound = f"> {minimum_exclusive:g}" if minimum_exclusive is not None else f">= {minimum:g}"
            raise ColiError(f"{option} {text!r}: each value must be {bound} (got {s!r})")
        out.append(v)
    return tuple(out)


def per_gpu(text: str, n_gpus: int, option: str, **bounds) -> tuple[float, ...]:
    """One value for every GPU, or exactly one value per GPU (in --gpus order)."""
    vals = parse_numbers(text, option, **bounds)
    if len(vals) == 1:
        return vals * n_gpus
    if len(vals) != n_gpus:
        raise ColiError(f"{option} {text!r} gives {len(vals)} values for {n_gpus} GPUs: give one value for all, or "
                        f"one per GPU in --gpus order")
    return vals
