"""The Hugging Face Hub as ColiStream uses it: `huggingface_hub` does the talking (its cache, token, HF_ENDPOINT and
retries); this module names a repo (`ORG/REPO[@REVISION]`), lists a revision's files with their sizes and hashes,
downloads one file and checks it against that listing, drops a file from the cache again, and turns every error a
downloader meets into one line that says what to do."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from coli.errors import ColiError

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HASH_CHUNK = 8 << 20


class HubError(ColiError):
    """A download failed: network, authentication, a missing repo/revision/file, a damaged file or a full disk."""


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None      # branch, tag or commit; None = the default branch

    @staticmethod
    def parse(text: str) -> "HubRef":
        """`ORG/REPO`, `ORG/REPO@REVISION`, optionally prefixed with hf://."""
        body = text[len("hf://"):] if text.startswith("hf://") else text
        repo, _, rev = body.partition("@")
        if not _REPO_RE.match(repo) or (_ and not rev):
            raise HubError(f"{text!r} is not a Hub repo: write ORG/REPO or ORG/REPO@REVISION (e.g. zai-org/GLM-5)")
        return HubRef(repo, rev or None)

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None     # LFS files: the content's sha256
    git_sha1: str | None   # other files: the git blob id


@dataclass(frozen=True)
class Listing:
    ref: HubRef
    commit: str                       # the revision resolved to a commit: every download pins it
    files: dict[str, RemoteFile]


def endpoint() -> str:
    from huggingface_hub import constants
    return constants.ENDPOINT


# ---- errors ------------------------------------------------------------------------------------------------------
def _disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def explain(e: BaseException, ref: HubRef, what: str) -> HubError | None:
    """One line for an error of huggingface_hub / the network / the disk met while doing `what`; None if unknown."""
    import httpx2
    from huggingface_hub import errors as he

    login = "log in with `hf auth login` (or set HF_TOKEN)"
    url = f"{endpoint()}/{ref.repo}"
    if isinstance(e, he.GatedRepoError):
        return HubError(f"{ref.repo} is gated: accept its conditions at {url} with your account, then {login}; "
                        f"then rerun the same command")
    if isinstance(e, he.RevisionNotFoundError):
        return HubError(f"{ref.repo} has no revision {ref.revision!r} (404): use a branch, tag or commit of "
                        f"{url}, or leave @REVISION out for the default branch")
    if isinstance(e, he.RemoteEntryNotFoundError):
        return HubError(f"{ref}: {what}: the file is not in that revision (404); is {ref.repo} the right repo?")
    if isinstance(e, he.RepositoryNotFoundError):
        return HubError(f"{ref.repo}: repository not found at {endpoint()} (it does not exist, or it is private "
                        f"and you are not logged in: {login}); check ORG/REPO")
    if isinstance(e, he.HfHubHTTPError) and e.response is not None:
        code = e.response.status_code
        if code in (401, 403):
            return HubError(f"{ref.repo}: access denied ({code}) while {what}: your token lacks permission for "
                            f"this repo; {login} with a token that can read it")
        if code >= 500 or code == 429:
            return HubError(f"the Hub at {endpoint()} answered {code} while {what}: it is down or busy; rerun the "
                            f"same command later (finished work is kept)")
        return HubError(f"the Hub at {endpoint()} answered {code} while {what}")
    if isinstance(e, OSError) and _disk_full(e):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return HubError(f"the disk filled up while {what}{where}: free space and rerun the same command to resume "
                        f"(finished work is kept)")
    if isinstance(e, (httpx2.TransportError, he.LocalEntryNotFoundError, he.OfflineModeIsEnabled,
                      ConnectionError, TimeoutError)):
        return HubError(f"cannot reach the Hub at {endpoint()} while {what} ({type(e).__name__}): check the network "
                        f"(or HF_ENDPOINT / HF_HUB_OFFLINE), then rerun the same command (finished work is kept)")
    if isinstance(e, OSError) and "Consistency check failed" in str(e):
        return HubError(f"{ref}: {what}: the download ended short of the size the Hub announced (connection "
                        f"dropped?); rerun the same command")
    return None


@contextmanager
def hub_errors(ref: HubRef, what: str) -> Iterator[None]:
    try:
        yield
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - translated when we know it, re-raised when we do not
        mine = explain(e, ref, what)
        if mine is None:
            raise
        raise mine from None


# ---- progress ------------------------------------------------------------------------------------------------------
def _progress_class(on_bytes: Callable[[int], None] | None):
    """A tqdm class for huggingface_hub's `tqdm_class` that draws nothing and hands each chunk's size to us."""
    from tqdm import tqdm

    class _Sink(tqdm):
        def __init__(self, *a, **k):
            k["disable"] = True
            super().__init__(*a, **k)

        def update(self, n=1):
            if on_bytes is not None and n:
                on_bytes(int(n))

    return _Sink


# ---- the client ----------------------------------------------------------------------------------------------------
class HubClient:
    """One repo at one revision. `cache_dir=None` is huggingface_hub's own cache (HF_HUB_CACHE / HF_HOME)."""

    def __init__(self, ref: HubRef, cache_dir: str | Path | None = None):
        from huggingface_hub import HfApi
        self.ref = ref
        self.cache_dir = str(cache_dir) if cache_dir else None
        self.api = HfApi()
        self._listing: Listing | None = None

    def listing(self) -> Listing:
        if self._listing is None:
            with hub_errors(self.ref, "listing the repo's files"):
                info = self.api.model_info(self.ref.repo, revision=self.ref.revision, files_metadata=True)
            files = {}
            for s in info.siblings or []:
                if s.size is None:
                    raise HubError(f"{self.ref}: the Hub listed {s.rfilename} without a size; cannot check it")
                files[s.rfilename] = RemoteFile(s.rfilename, int(s.size), s.lfs.sha256 if s.lfs else None,
                                                None if s.lfs else s.blob_id)
            if not info.sha:
                raise HubError(f"{self.ref}: the Hub did not say which commit the revision is; is HF_ENDPOINT a Hub?")
            self._listing = Listing(self.ref, info.sha, files)
        return self._listing

    @property
    def storage(self) -> Path:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        return Path(self.cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=self.ref.repo, repo_type="model")

    def remote(self, name: str) -> RemoteFile:
        f = self.listing().files.get(name)
        if f is None:
            raise HubError(f"{self.ref}: the revision has no file {name!r}")
        return f

    def download(self, name: str, on_bytes: Callable[[int], None] | None = None,
                 local_dir: Path | None = None) -> Path:
        """The file, in the cache (or in local_dir), checked against the listing's size and hash; a file that
        disagrees is deleted and reported."""
        from huggingface_hub import hf_hub_download

        want = self.remote(name)
        with hub_errors(self.ref, f"downloading {name}"):
            path = Path(hf_hub_download(self.ref.repo, name, revision=self.listing().commit,
                                        cache_dir=self.cache_dir, local_dir=local_dir,
                                        tqdm_class=_progress_class(on_bytes)))
        problem = check_file(path, want)
        if problem:
            self.evict(path)
            raise HubError(f"{self.ref}: {name}: {problem}; the damaged download was deleted: rerun the same command "
                           f"to fetch it again (if it repeats, the repo itself is inconsistent)")
        return path

    def evict(self, path: Path) -> None:
        """Drop a downloaded file: the snapshot link and the blob it points to."""
        try:
            blob = path.resolve() if path.is_symlink() else None
            path.unlink(missing_ok=True)
            if blob is not None:
                blob.unlink(missing_ok=True)
        except OSError as e:
            raise HubError(f"{path}: cannot delete the downloaded file: {e.strerror}") from None

    def cached(self, name: str) -> Path:
        """Where the cache keeps `name` of this commit (it may not be there)."""
        return self.storage / "snapshots" / self.listing().commit / name

    def sweep_partials(self) -> list[Path]:
        """Temporary `*.incomplete` blobs of downloads whose process is gone (huggingface_hub names them per
        process and removes them itself unless it was killed)."""
        removed = []
        blobs = self.storage / "blobs"
        if blobs.is_dir():
            lock = self.storage.parent / ".locks" / self.storage.name
            for p in blobs.glob("*.incomplete"):
                etag = p.name.split(".")[0]
                if _locked(lock / f"{etag}.lock"):
                    continue   # a live download holds its lock
                p.unlink(missing_ok=True)
                removed.append(p)
        return removed


def _locked(lock: Path) -> bool:
    import fcntl
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def check_file(path: Path, want: RemoteFile) -> str | None:
    """Why the file disagrees with the Hub's listing (size, then sha256 or git blob id), or None."""
    size = path.stat().st_size
    if size != want.size:
        return f"{size} bytes on disk, the Hub's index says {want.size}"
    if want.sha256:
        h = hashlib.sha256()
    elif want.git_sha1:
        h = hashlib.sha1(f"blob {size}\0".encode())
    else:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    expected = want.sha256 or want.git_sha1
    if h.hexdigest() != expected:
        kind = "sha256" if want.sha256 else "git blob id"
        return f"{kind} {h.hexdigest()[:16]}... disagrees with the Hub's index ({expected[:16]}...)"
    return None
