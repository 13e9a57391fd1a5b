"""CPU reference tokens of the shipped trained pair (models/): plain greedy on the torch reference modules,
fp32, for the held-out prompts. The GPU tests compare against them; they are computed here once (the CPU
reference takes ~20 s a prompt) and stored with a hash of the checkpoint files they came from.

    python tests/reference_tokens.py        # rewrites tests/data/trained_greedy_128.json
"""
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
PATH = os.path.join(ROOT, "tests", "data", "trained_greedy_128.json")
N_PROMPTS, N_NEW = 16, 128


def heldout_prompts() -> list[str]:
    with open(os.path.join(ROOT, "tests", "prompts_heldout.txt")) as f:
        return [json.loads(x) for x in f if x.strip() and not x.startswith("#")]


def models_hash() -> str:
    """Of the target's files only: the tokens are plain greedy, so a new drafter leaves them valid."""
    h = hashlib.sha256()
    for sub in ("target",):
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(MODELS, sub, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def load_reference():
    """The stored tokens, or None when they were made from other checkpoint files."""
    if not os.path.isfile(PATH):
        return None
    with open(PATH) as f:
        ref = json.load(f)
    return ref if ref.get("models_sha256") == models_hash() else None


def main() -> int:
    from dflash_trt import PoolSizes, load_runtime

    rt, codec = load_runtime(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), "torch",
                             PoolSizes(max_seq_len=512, kv_blocks=64, dkv_blocks=96))
    prompts = heldout_prompts()[:N_PROMPTS]
    tokens = []
    for i, p in enumerate(prompts):
        tokens.append(rt.generate(codec.encode(p), N_NEW, spec=False)[0])
        print(f"{i + 1}/{len(prompts)}: {len(tokens[-1])} tokens", flush=True)
    with open(PATH, "w") as f:
        json.dump({"models_sha256": models_hash(), "max_new_tokens": N_NEW, "prompts": prompts,
                   "prompt_ids": [codec.encode(p) for p in prompts], "tokens": tokens}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
