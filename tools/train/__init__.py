"""Train the small hybrid target + DFlash drafter pair shipped under models/ (the embedded default).

What is trained is the project's own modules, dflash_trt.modeling.target.TargetModel and
dflash_trt.modeling.drafter.Drafter, through their training paths (TargetModel.forward_train,
Drafter.train_forward; tests/test_train.py checks both against the graph path the runtime runs), and
saved under the parameter names dflash_trt.export.checkpoint reads. The drafter's labels are greedy
continuations produced by the project's Runtime (torch backend).

Everything is seeded and reads only what every machine has: the Python standard library's own `.py`
sources are the corpus. Stages (`python -m dflash_trt.tools.train STAGE`):

  prepare   corpus -> byte-level BPE tokenizer (`tokenizers`, vocab 4096, `<|endoftext|>` eos,
            `<|mask|>` for the drafter) -> uint16 token streams (train / held-out, split by a hash of
            each file's path) + held-out prompts (first lines of functions of held-out files).
            Runs on CPU; its output dir is what the GPU stage reads, so the GPU machine needs neither
            the same Python stdlib nor the `tokenizers` package.            (data.py)
  train     target: Qwen3.5 text layout (qwen3_5_text, 3 GDN : 1 attention), next-token loss, bf16
            autocast, AdamW, cosine LR, step count fitted to a wall-clock budget (logged, so a rerun can
            pin it with --target-steps). Then the weights are rounded to bf16 (what is saved is what
            generates the drafter's data), the target greedily continues prompts cut from training
            files, and a DFlash drafter (block 16, z-lab tap rule) is trained on the frozen target's
            hidden states with the block-wise loss of the DFlash paper (arXiv 2602.06036): random
            anchors, block = [anchor token, MASK x15] at positions anchor..anchor+15, the context is
            the target's tap rows at positions < anchor, slot j >= 1 predicts the token at anchor+j,
            cross-entropy weighted w_j = exp(-(j-1)/gamma). Labels are the target's own greedy
            continuation, so "slot j correct and all before it" is exactly "draft j accepted".
            Writes HF-format dirs (config.json + safetensors, bf16) and train_log.json.
            (stages.py, target.py, drafter.py, generate.py)
  finalize  merge shards (the GPU machine returns files of <= 16 MB), add tokenizer.json and
            generation_config.json -> models/target, models/drafter.                      (save.py)
  tune      fine-tune the drafter on the target's greedy continuations of *function starts* of training
            files (the `def` line + first body line, like the held-out prompts): the regime generate,
            demo and the tests run in (short context, first ~64 tokens). The GPU stage's generic data
            (random windows, 320-token continuations that end up in repetitive loops) gives a high
            offline tau there but a low one at the start of a function. CPU-friendly; reports the
            exact offline replay of greedy speculative decoding.                          (tune.py)
  all       prepare + train + finalize + the SHIPPED_TUNES (tune.py) in one go (one machine).

How models/ was made: prepare, finalize and the first two tunes on the CPU, train and the last tune on one
GPU, with the stages, arguments, defaults and seeds of the commands below; the drafter was trained in a second
`train` run from the first run's target (models/train_log.json holds every figure, docs/PERF.md the runs).

As commands (the budgets' step counts pinned: both fits happen at step 40, inside the
warmup, so a pinned run has the same LR schedule; GPU bf16 training is not bit-reproducible):
  T="python -m dflash_trt.tools.train"
  $T prepare --work .train_data --prompts-out tests/prompts_heldout.txt
  $T train --work .train_data --out RUN1 --target-steps 1456
  $T train --work .train_data --out RUN2 --init-target RUN1/target --drafter-steps 4535 --held-prompt-lens 8,32
  $T finalize --src RUN2 --target-src RUN1 --work .train_data --models models
  $T tune --models models --work .train_data --n-train 6144 --lengths 8 --steps 1800 --lr 1e-3 --decay-gamma 7 --seed 0
  $T tune --models models --work .train_data --n-train 12288 --lengths 24 --steps 2400 --lr 7e-4 --decay-gamma 5 --seed 1
  $T snippets --work .train_data --out snippets.json --n-train 60000 --n-held 256 --lengths 0     # CPU
  $T tune --models models --work /tmp/w --snippets snippets.json --n-train 28000 --new-tokens 144 --replay 128 \
      --dtypes float32,bfloat16 --seconds 180 --batch 64 --anchors 16 --lr 8e-4 --decay-gamma 7 --seed 2  # GPU
  (`all --out RUN` does prepare + train + finalize + both tunes in one go, one run instead of two.)

Speed: training does not go through TargetModel.step (paged attention, fold data, per-sequence
loops): TargetModel.forward_train is the same math, dense: causal SDPA for attention, the GDN in
chunked WY form with all chunks' intra-chunk work batched (chunk 64, triangular solve) and only the
state hand-off looped. The end of `train` logs both checks on the trained weights (fast vs graph path).

A CPU smoke run of every stage on a few files and tiny shapes (--max-files, --vocab, --small,
--target-steps, --drafter-steps, --n-gen, --n-held, --gen-len): tests/test_train.py.
"""
