"""Fingerprints of a model's files: the same base weights and tokenizer give the same strings on every host.

The learner computes them at start; a generator computes them on its host before it builds its engine, and the hub
refuses one whose fingerprints differ (pipeline/runspec.py); a checkpoint records the learner's, and a resume on
other files is refused (learner/checkpoint.py).

    model.path       the weight files a loader reads (*.safetensors, else *.bin / *.pt), each hashed in 64 MiB
                     pieces on several threads (hashlib releases the GIL), and config.json without the fields a
                     save stamps (transformers_version, _name_or_path)
    model.tokenizer  the tokenizer's files (vocabulary, merges, special tokens, chat template)

A file's digest is cached by path, size, modification time and inode (PIPELINE_CACHE/fingerprints.json), so a 7B
model is read once per machine, not at every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PIECE = 64 * 2**20  # bytes hashed at once: the pieces of one file hash on several threads
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # the first pattern with files is what a loader reads
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
             "spiece.model")
STAMPED = ("transformers_version", "_name_or_path", "name_or_path")  # written by whoever saved the files


def fingerprints(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> dict[str, str]:
    """{"model.path": ..., "model.tokenizer": ...} of a local model directory (and the tokenizer's, if elsewhere)."""
    model_dir = Path(model_dir)
    return {"model.path": weights_fingerprint(model_dir),
            "model.tokenizer": tokenizer_fingerprint(Path(tokenizer_dir or model_dir))}


def of_model(model) -> dict[str, str]:
    """The fingerprints of the files a `model` config section names on this host (`builtin:` models built, hub names
    downloaded as the loaders would); FileNotFoundError where they are not."""
    from pipeline.tinymodel import resolve_model_path

    tokenizer = local_dir(model.tokenizer) if model.tokenizer else None
    return fingerprints(local_dir(resolve_model_path(model.path)), tokenizer)


def local_dir(path: str) -> Path:
    """A model's directory on this host: `path` itself, or a hub name's snapshot (downloaded if it is not cached,
    as the loaders would). FileNotFoundError names what is missing."""
    if Path(path).is_dir():
        return Path(path)
    if path.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"{path}: no such directory on this host")
    from huggingface_hub import snapshot_download

    try:
        for weights in WEIGHTS:  # the files a loader reads, not every format the repository holds
            found = Path(snapshot_download(path, allow_patterns=[weights, "*.json", *TOKENIZER]))
            if any(found.glob(weights)):
                return found
    except Exception as e:  # not on the hub, no network, no access: the same for the loaders
        raise FileNotFoundError(f"{path}: neither a directory on this host nor a model its hub serves ({e})") from e
    raise FileNotFoundError(f"{path}: the hub's repository holds no weight files ({', '.join(WEIGHTS)})")


def weights_fingerprint(model_dir: Path) -> str:
    files = next((sorted(model_dir.glob(p)) for p in WEIGHTS if any(model_dir.glob(p))), [])
    if not files:
        raise FileNotFoundError(f"{model_dir}: no weight files ({', '.join(WEIGHTS)})")
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if config.exists():
        h.update(_canonical_json(config))
    for f, digest in zip(files, _file_digests(files), strict=True):
        h.update(f"{f.name}:{f.stat().st_size}:{digest}\n".encode())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer_dir: Path) -> str:
    files = [tokenizer_dir / name for name in TOKENIZER if (tokenizer_dir / name).exists()]
    if not files:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER[:3])}, ...)")
    h = hashlib.sha256()
    for f in files:
        data = _canonical_json(f) if f.suffix == ".json" else f.read_bytes()
        h.update(f"{f.name}:{len(data)}:".encode() + hashlib.sha256(data).digest())
    return h.hexdigest()[:32]


def _canonical_json(path: Path) -> bytes:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in STAMPED}
    return json.dumps(data, sort_keys=True).encode()


def _file_digests(files: list[Path]) -> list[str]:
    cache_path = _cache_path()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    keys = [_stat_key(f) for f in files]
    todo = [(f, k) for f, k in zip(files, keys, strict=True) if k not in cache]
    if todo:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            for f, key in todo:
                cache[key] = _hash_file(f, pool)
        with contextlib.suppress(OSError):  # a cache that cannot be written costs a rehash next time, no more
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".fingerprints-")
            with os.fdopen(fd, "w") as out:
                json.dump(cache, out)
            os.replace(tmp, cache_path)
    return [cache[k] for k in keys]


def _hash_file(path: Path, pool: ThreadPoolExecutor) -> str:
    size = path.stat().st_size

    def piece(offset: int) -> bytes:
        with path.open("rb") as f:
            f.seek(offset)
            return hashlib.sha256(f.read(PIECE)).digest()

    return hashlib.sha256(b"".join(pool.map(piece, range(0, max(size, 1), PIECE)))).hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _cache_path() -> Path:
    from pipeline.tinymodel import cache_root

    return cache_root() / "fingerprints.json"
