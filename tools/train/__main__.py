"""CLI: python -m dflash_trt.tools.train {prepare,train,finalize,tune,all} (see the package docstring)."""
from __future__ import annotations

import argparse
import sys

from dflash_trt.tools import train as pkg


def _int_list(s):
    return [int(x) for x in s.split(",")] if s else None


def parser() -> argparse.ArgumentParser:
    # the whole package docstring: --help is also the record of how models/ was made
    p = argparse.ArgumentParser(prog="python -m dflash_trt.tools.train", description=pkg.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def prepare_args(sp):
        sp.add_argument("--work", default=".train_data", help="output dir (tokenizer, token streams, prompts)")
        sp.add_argument("--vocab", type=int, default=4096)
        sp.add_argument("--prompts", type=int, default=24, help="number of held-out prompts")
        sp.add_argument("--prompts-out", default=None, help="also write the held-out prompts here")
        sp.add_argument("--stdlib", default=None, help="stdlib dir (default: sysconfig's)")
        sp.add_argument("--max-files", type=int, default=None,
                        help="smoke runs: the first N training files (+ N//8 held-out ones) only")

    pp = sub.add_parser("prepare", help="corpus -> tokenizer, token streams, held-out prompts (CPU)")
    prepare_args(pp)
    pp.add_argument("--seed", type=int, default=0, help="held-out prompt choice")
    for name, what in (("train", "train the target, then the drafter (GPU)"),
                       ("all", "prepare + train + finalize + the SHIPPED_TUNES")):
        tp = sub.add_parser(name, help=what)
        if name == "all":
            prepare_args(tp)
            tp.add_argument("--models", default="models")
        else:
            tp.add_argument("--work", default=".train_data")
        tp.add_argument("--out", required=True, help="run dir: target/, drafter/, train_log.json")
        tp.add_argument("--target-seconds", type=float, default=190)
        tp.add_argument("--drafter-seconds", type=float, default=120)
        tp.add_argument("--target-steps", type=int, default=None, help="pin the step count (else fit to seconds)")
        tp.add_argument("--drafter-steps", type=int, default=None)
        tp.add_argument("--n-gen", type=int, default=None,
                        help="greedy continuations for the drafter (default 16384; --small/--smoke 64)")
        tp.add_argument("--n-held", type=int, default=None, help="held-out continuations (default 512; lite 16)")
        tp.add_argument("--gen-len", type=int, default=None, help="continuation length (default 320; lite 96)")
        tp.add_argument("--device", default=None)
        tp.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
        tp.add_argument("--smoke", action="store_true", help="real shapes, tiny batches/data (CPU smoke run)")
        tp.add_argument("--max-shard-mb", type=int, default=15)
        tp.add_argument("--init-target", default=None, help="target dir of an earlier run: train the drafter only")
        tp.add_argument("--held-prompt-lens", default=None, help="comma list, prompt lengths of held-out continuations")
        tp.add_argument("--seed", type=int, default=0)
    fp = sub.add_parser("finalize", help="run dir -> models/ (merged shards, tokenizer, generation config, log)")
    fp.add_argument("--src", required=True)
    fp.add_argument("--work", default=".train_data")
    fp.add_argument("--models", default="models")
    fp.add_argument("--target-src", default=None, help="take target/ (and its log) from this run's dir instead")
    up = sub.add_parser("tune", help="fine-tune models/drafter on function-start continuations (CPU-friendly)")
    up.add_argument("--models", default="models")
    up.add_argument("--work", default=".train_data")
    up.add_argument("--out", default=None, help="where drafter/ goes (default: --models, in place)")
    up.add_argument("--n-train", type=int, default=6144)
    up.add_argument("--n-held", type=int, default=256)
    up.add_argument("--new-tokens", type=int, default=80, help="greedy tokens generated after each snippet")
    up.add_argument("--steps", type=int, default=1800)
    up.add_argument("--batch", type=int, default=32)
    up.add_argument("--device", default=None)
    up.add_argument("--lr", type=float, default=1e-3)
    up.add_argument("--anchors", type=int, default=8)
    up.add_argument("--seed", type=int, default=0)
    up.add_argument("--lengths", type=int, default=8, help="use snippets of the N most common token lengths (0: all)")
    up.add_argument("--snippets", default=None, help="a `snippets` file instead of the corpus (a GPU machine)")
    up.add_argument("--dtypes", default="float32", help="target dtypes the data is generated in, comma list")
    up.add_argument("--replay", type=int, default=64, help="new tokens of the replayed held-out tau")
    up.add_argument("--seconds", type=float, default=None, help="fit the step count to this budget (not --steps)")
    sp = sub.add_parser("snippets", help="choose tune's function starts from the corpus -> a JSON file (CPU)")
    sp.add_argument("--models", default="models")
    sp.add_argument("--work", default=".train_data")
    sp.add_argument("--out", required=True)
    sp.add_argument("--n-train", type=int, default=6144)
    sp.add_argument("--n-held", type=int, default=256)
    sp.add_argument("--lengths", type=int, default=8, help="the N most common token lengths (0: all)")
    sp.add_argument("--seed", type=int, default=0)
    up.add_argument("--decay-gamma", type=float, default=7.0, help="loss weight exp(-(j-1)/gamma) of slot j")
    return p


def main(argv=None) -> int:
    from dflash_trt.tools.train.data import prepare
    from dflash_trt.tools.train.save import finalize
    from dflash_trt.tools.train.stages import train
    from dflash_trt.tools.train.tune import SHIPPED_TUNES, tune, write_snippets

    a = parser().parse_args(argv)
    if a.cmd in ("prepare", "all"):
        prepare(a.work, a.vocab, a.seed, a.prompts, a.prompts_out, a.stdlib, a.max_files)
    if a.cmd in ("train", "all"):
        train(a.work, a.out, a.target_seconds, a.drafter_seconds, a.target_steps, a.drafter_steps, a.seed,
              a.device, n_gen=a.n_gen, n_held=a.n_held, gen_len=a.gen_len, small=a.small,
              max_shard_mb=a.max_shard_mb, smoke=a.smoke, init_target=a.init_target,
              held_prompt_lens=_int_list(a.held_prompt_lens))
    if a.cmd == "all":
        finalize(a.out, a.work, a.models)
        for kw in SHIPPED_TUNES:
            tune(a.models, a.work, a.models, device=a.device, **kw)
    elif a.cmd == "tune":
        tune(a.models, a.work, a.out, n_train=a.n_train, n_held=a.n_held, n_new=a.new_tokens, steps=a.steps,
             batch=a.batch, anchors=a.anchors, lr=a.lr, seed=a.seed, device=a.device, n_lengths=a.lengths,
             decay_gamma=a.decay_gamma, snippets=a.snippets, dtypes=tuple(a.dtypes.split(",")), replay=a.replay,
             seconds=a.seconds)
    elif a.cmd == "snippets":
        write_snippets(a.out, a.work, a.models, a.n_train, a.n_held, a.lengths, a.seed)
    elif a.cmd == "finalize":
        finalize(a.src, a.work, a.models, a.target_src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
