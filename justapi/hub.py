"""Models by name from a Hugging Face hub: ``justapi pull ORG/REPO[:QUANT]`` and ``--model hf:ORG/REPO[:QUANT]``,
through ``huggingface_hub`` (its cache, its download retries that resume an interrupted transfer with a Range
request, its progress bar, its token: ``HF_TOKEN`` or ``hf auth login``; ``HF_ENDPOINT`` names another hub).

The repository's GGUF file is chosen by QUANT (a part of its name, ``Q4_K_M`` by default where there is one, as
llama.cpp's ``-hf`` does); a fresh download is checked against the SHA-256 the hub lists for it and removed where it
differs. Offline, a repository already in the cache is served from it.
"""

from __future__ import annotations

import hashlib
import os
import re

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class HubError(Exception):
    """A model that cannot be had from the hub: the message says why, in one line."""


def is_hub_ref(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_ref(ref: str) -> tuple[str, str | None]:
    """(``ORG/REPO``, the quantization asked for or None) from ``[hf:]ORG/REPO[:QUANT]``."""
    repo, _, quant = ref.removeprefix(PREFIX).partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"{ref!r} is not ORG/REPO[:QUANT] (e.g. unsloth/Qwen3-0.6B-GGUF:Q4_K_M)")
    return repo, quant or None


def choose_file(repo: str, files: list[str], quant: str | None) -> str:
    """The GGUF of ``files`` to serve: the one whose name holds ``quant`` (DEFAULT_QUANT, else the only or first one,
    where none is asked for); projector files (mmproj) are not models."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in os.path.basename(f).lower())
    if not ggufs:
        raise HubError(f"{repo} has no .gguf file")
    wanted = quant or DEFAULT_QUANT
    matches = [f for f in ggufs if wanted.lower() in os.path.basename(f).lower()]
    if not matches and quant is not None:
        raise HubError(f"{repo} has no .gguf file for {quant}; it has: {', '.join(os.path.basename(f) for f in ggufs)}")
    chosen = min(matches or ggufs, key=lambda f: (len(os.path.basename(f)), f))
    if _SPLIT.search(chosen):
        raise HubError(f"{repo}: {os.path.basename(chosen)} is one part of a split GGUF, which JustAPI does not "
                       "read yet; merge it with llama.cpp's llama-gguf-split --merge, or pick another quantization")
    return chosen


def pull(ref: str) -> str:
    """The local path of the model ``ref`` names, downloaded into huggingface_hub's cache where it is not there."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub import errors

    repo, quant = parse_ref(ref)
    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise HubError(f"{repo}: {_first_line(e)}") from None
    except Exception as e:  # offline, the hub failing, a proxy in the way (httpx's errors are no OSError): the cache
        return _cached(repo, quant, e)
    name = choose_file(repo, [s.rfilename for s in info.siblings or []], quant)
    sibling = next(s for s in info.siblings or [] if s.rfilename == name)
    fresh = not isinstance(try_to_load_from_cache(repo, name), str)
    try:
        path = hf_hub_download(repo, name)  # the main branch, whose ref the cache keeps for offline use
    except Exception as e:  # whatever the transfer raised, said in one line
        raise HubError(f"{repo}/{name}: the download failed: {_first_line(e)}") from None
    expected = sibling.lfs.sha256 if sibling.lfs is not None else None
    if fresh and expected is not None:
        got = sha256_of(path)
        if got != expected:
            _remove_cached(path)
            raise HubError(f"{repo}/{name}: checksum mismatch (SHA-256 {got[:16]}..., the hub lists "
                           f"{expected[:16]}...): the download was removed; pull it again")
    return path


def _cached(repo: str, quant: str | None, why: Exception) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors

    try:
        folder = snapshot_download(repo, allow_patterns=["*.gguf"], local_files_only=True)
    except (errors.LocalEntryNotFoundError, OSError, ValueError):
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        raise HubError(f"cannot reach the hub at {endpoint} ({_first_line(why)}) and {repo} is not in the cache") \
            from None
    files = [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]
    return os.path.join(folder, choose_file(repo, files, quant))


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove_cached(path: str) -> None:
    """A cached file and the blob its snapshot link points to."""
    blob = os.path.realpath(path)
    for p in (path, blob):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
