"""Fingerprints of a model's files: the same base weights and tokenizer give the same strings on every host.

The learner computes them at start; a generator computes them on its host before it builds its engine, and the hub
refuses one whose fingerprints differ (pipeline/runspec.py); a checkpoint records the learner's, and a resume on
other files is refused (learner/checkpoint.py).

    model.path       the weight files a loader reads, each hashed in 64 MiB pieces on several threads (hashlib
                     releases the GIL); config.json and generation_config.json (vLLM stops at its EOS ids) without
                     the fields a save stamps (transformers_version, _name_or_path)
    model.tokenizer  the tokenizer's files (vocabulary, merges, special tokens, chat template)

The weight files are those a sharded checkpoint's index names (its weight_map is hashed too, not its metadata), else
every *.safetensors, else *.bin / *.pt: a stray file beside an index is not read by a loader, nor hashed. FORMAT
numbers this way of hashing (1: without generation_config.json and the index); a checkpoint records its own, so one
of an earlier release is checked as it was written.

A file's digest is cached by path, size, modification time, inode and change time (PIPELINE_CACHE/fingerprints.json),
so a 7B model is read once per machine, not at every start. No one can set the change time: a file rewritten in place
with its modification time restored (`cp -p`) is hashed again. A file changed in the last second is not cached (as
git's racily clean files): a write within its timestamps' granularity could leave all five as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PIECE = 64 * 2**20  # bytes hashed at once: the pieces of one file hash on several threads
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # the first pattern with files is what a loader reads
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
             "spiece.model")
STAMPED = ("transformers_version", "_name_or_path", "name_or_path")  # written by whoever saved the files
INDEXES = {"*.safetensors": "model.safetensors.index.json", "*.bin": "pytorch_model.bin.index.json"}  # of shards
NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")  # vLLM skips them
FORMAT = 2  # how model.path is hashed; 1, the earlier releases' way, is still computed for their checkpoints
SETTLED_NS = 10**9  # a file changed more recently may change again under the same timestamps: hashed, not cached


def fingerprints(model_dir: str | Path, tokenizer_dir: str | Path | None = None, form: int = FORMAT) -> dict[str, str]:
    """{"model.path": ..., "model.tokenizer": ...} of a local model directory (and the tokenizer's, if elsewhere);
    `form`: how model.path is hashed (FORMAT)."""
    model_dir = Path(model_dir)
    return {"model.path": weights_fingerprint(model_dir, form),
            "model.tokenizer": tokenizer_fingerprint(Path(tokenizer_dir or model_dir))}


def of_model(model, form: int = FORMAT) -> dict[str, str]:
    """The fingerprints of the files a `model` config section names on this host (`builtin:` models built, hub names
    downloaded as the loaders would); FileNotFoundError where they are not."""
    from pipeline.tinymodel import resolve_model_path

    tokenizer = local_dir(model.tokenizer) if model.tokenizer else None
    return fingerprints(local_dir(resolve_model_path(model.path)), tokenizer, form)


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


def weights_fingerprint(model_dir: Path, form: int = FORMAT) -> str:
    """`form` 1 (checkpoints of earlier releases): config.json and every file of the first weight pattern."""
    if form not in (1, FORMAT):
        raise ValueError(f"fingerprint format {form}: this release knows 1 and {FORMAT}")
    files, weight_map = weight_files(model_dir, form)
    h = hashlib.sha256()
    config, generation = model_dir / "config.json", model_dir / "generation_config.json"
    if config.exists():
        h.update(_canonical_json(config))
    if form > 1 and generation.exists():
        h.update(b"generation_config.json:" + _canonical_json(generation))
    if weight_map:  # which file holds which tensor; not the index's metadata (total_size)
        h.update(b"weight_map:" + json.dumps(weight_map, sort_keys=True).encode())
    for f, digest in zip(files, _file_digests(files), strict=True):
        h.update(f"{f.name}:{f.stat().st_size}:{digest}\n".encode())
    return h.hexdigest()[:32]


def weight_files(model_dir: Path, form: int = FORMAT) -> tuple[list[Path], dict | None]:
    """The weight files a loader reads (of the first of WEIGHTS' patterns with files, those its index names, else
    all but NOT_WEIGHTS), and the weight_map of that index (None: none). FileNotFoundError where there are none, or
    the index names one that is not there. `form` 1: the earlier releases' choice, every file of the first pattern
    (their checkpoints' fingerprints). pipeline/memory.py counts the weights of these files too."""
    def found(pattern: str) -> list[Path]:
        return sorted(f for f in model_dir.glob(pattern) if form == 1 or f.name not in NOT_WEIGHTS)

    pattern = next((p for p in WEIGHTS if found(p)), None)
    if pattern is None:
        raise FileNotFoundError(f"{model_dir}: no weight files ({', '.join(WEIGHTS)})")
    index = model_dir / INDEXES[pattern] if pattern in INDEXES else None
    if form == 1 or not (index and index.is_file()):
        return found(pattern), None
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(model_dir / name for name in set(weight_map.values()))
    if missing := [f.name for f in files if not f.is_file()]:
        raise FileNotFoundError(f"{index}: names weight files that are not there ({', '.join(missing[:3])})")
    return files, weight_map


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
    stats = [f.stat() for f in files]  # before the files are read: a write after it changes them
    settled = time.time_ns() - SETTLED_NS
    keys = [_stat_key(f, st) for f, st in zip(files, stats, strict=True)]
    todo = [(f, k, st) for f, k, st in zip(files, keys, stats, strict=True) if k not in cache]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        digests = {key: _hash_file(f, pool) for f, key, _ in todo}
    if fresh := {k: digests[k] for _, k, st in todo if st.st_ctime_ns < settled}:
        cache.update(fresh)
        with contextlib.suppress(OSError):  # a cache that cannot be written costs a rehash next time, no more
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".fingerprints-")
            with os.fdopen(fd, "w") as out:
                json.dump(cache, out)
            os.replace(tmp, cache_path)
    return [digests.get(k) or cache[k] for k in keys]


def _hash_file(path: Path, pool: ThreadPoolExecutor) -> str:
    size = path.stat().st_size

    def piece(offset: int) -> bytes:
        with path.open("rb") as f:
            f.seek(offset)
            return hashlib.sha256(f.read(PIECE)).digest()

    return hashlib.sha256(b"".join(pool.map(piece, range(0, max(size, 1), PIECE)))).hexdigest()


def _stat_key(path: Path, st: os.stat_result) -> str:
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"


def _cache_path() -> Path:
    from pipeline.tinymodel import cache_root

    return cache_root() / "fingerprints.json"
