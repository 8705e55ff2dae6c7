"""`coli pull ORG/REPO[@REVISION] [DIR]`: download a published ColiStream container, verify it, register it.

Every file of the revision is fetched through huggingface_hub into DIR (its local-dir mode: re-running skips files
already there and fetches the rest) and checked against the Hub's listing (size, sha256). Then every checksum of
the container's manifest is recomputed (`coli verify`). The registry entry is written before the download as
unverified, and marked verified only after both checks pass: `coli up --model ORG/REPO` refuses it until then."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coli.container.dir_lock import sole_writer
from coli.container.format import MANIFEST_NAME, ContainerError
from coli.hub import registry
from coli.hub.client import HubClient, HubError, HubRef, hub_errors
from coli.hub.progress import human_bytes


@dataclass
class PullResult:
    name: str
    path: Path
    commit: str
    downloaded: int        # bytes fetched by this run
    size: int              # the container's bytes
    checked: int           # checksums recomputed


def default_dir(ref: HubRef, commit: str) -> Path:
    return registry.home() / "models" / f"{ref.repo.replace('/', '--')}--{commit[:12]}"


def pull(ref_text: str, dest: Path | None = None, *, report: Callable[[str], None] = print,
         on_download: Callable[[int, int], None] | None = None,
         on_verify: Callable[[int, int], None] | None = None) -> PullResult:
    ref = HubRef.parse(ref_text)
    with hub_errors(ref, "pulling"):
        return _pull(ref, dest, report, on_download, on_verify)


def _pull(ref, dest, report, on_download, on_verify) -> PullResult:
    client = HubClient(ref)
    listing = client.listing()
    if MANIFEST_NAME not in listing.files:
        raise HubError(f"{ref} is not a ColiStream container (no {MANIFEST_NAME}); to convert a Hugging Face "
                       f"checkpoint use `coli convert hf://{ref} DST`")
    d = Path(dest) if dest else default_dir(ref, listing.commit)
    if d.is_dir() and any(d.iterdir()) and not (d / ".cache" / "huggingface").is_dir():
        raise HubError(f"DIR {d} is not empty and holds no earlier pull; choose an empty or new directory")
    d.mkdir(parents=True, exist_ok=True)
    with sole_writer(d, "coli pull", HubError):
        # partial files of a killed pull (huggingface_hub names them per process and cannot reuse them)
        for p in (d / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
            p.unlink(missing_ok=True)
        return _pull_locked(ref, client, listing, d, report, on_download, on_verify)


def _pull_locked(ref, client, listing, d, report, on_download, on_verify) -> PullResult:
    from coli.container.check import verify_container

    old = registry.get(ref.repo)
    if old is not None and Path(old.path).resolve() != d.resolve() and Path(old.path).exists():
        report(f"{ref.repo} is also at {old.path} (`coli models rm {ref.repo}` removes that copy); "
               f"registering {d} instead")
    # the manifest last: a container dir without it is never mistaken for a finished one
    names = sorted(listing.files, key=lambda n: (n == MANIFEST_NAME, n))
    total = sum(f.size for f in listing.files.values())
    have = sum(f.size for n, f in listing.files.items() if (d / n).is_file() and (d / n).stat().st_size == f.size)
    free = shutil.disk_usage(d).free
    if total - have > free:
        raise HubError(f"not enough disk at {d}: {ref} needs {human_bytes(total - have)} more, {human_bytes(free)} "
                       f"free: free space or pull into another DIR")
    report(f"pulling {ref} (commit {listing.commit[:12]}, {len(names)} files, {human_bytes(total)}) into {d}")
    registry.put(registry.Entry(ref.repo, str(d.resolve()), "pulled", f"hf://{ref.repo}@{listing.commit}",
                                verified=False))
    done = fetched = 0
    n_in_file = [0]
    for name in names:
        n_in_file[0] = 0

        def count(n: int) -> None:
            nonlocal fetched
            n_in_file[0] += n
            fetched += n
            if on_download:
                on_download(done + n_in_file[0], total)
        client.download(name, on_bytes=count, local_dir=d)
        done += listing.files[name].size
        if on_download:
            on_download(done, total)
    try:
        rep = verify_container(d, progress=on_verify)
    except ContainerError as e:
        raise HubError(f"{ref}: the downloaded container is unusable: {e}") from None
    if not rep.ok:
        for bad in {b.file for b in rep.bad}:   # so that a rerun fetches them again
            Path(bad).unlink(missing_ok=True)
        raise HubError(f"{ref}: refused: {rep.bad[0].describe()} ({len(rep.bad)} bad extent(s)); the damaged "
                       f"file was deleted and {ref.repo} stays unusable: rerun `coli pull {ref}` (if it repeats, "
                       f"the published container itself is damaged)")
    from coli.container.format import parse_manifest
    m = parse_manifest(d / MANIFEST_NAME)
    size = registry.dir_size(d)
    registry.put(registry.Entry(ref.repo, str(d.resolve()), "pulled", f"hf://{ref.repo}@{listing.commit}",
                                registry.describe_format(m.args), size, verified=True))
    return PullResult(ref.repo, d, listing.commit, fetched, size, rep.checked)
