"""Save -> restore (in a NEW process) -> continue == the uninterrupted run.

The oracle is the uninterrupted run with the same settings: its tokens, its per-step accepted counts and
the drafts the real drafter proposed at every step (they depend on the ctx K/V rows, positions and window
bookkeeping, which the tokens alone would not show: spec decoding is lossless whatever the drafts).
The drafter is ScriptedDrafter (drafts right for step % (γ+1) slots), so every commit size occurs; the
ctx window (12) is small enough to slide before the save.
The child process imports this module (python -c with cwd=tests/, so '' on sys.path finds it) and runs
child_main on a JSON job file.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from spec_helpers import ScriptedDrafter

from dflash_trt.abi import DRAFTER_BLOCK, PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.devices.torch_device import TorchDevice
from dflash_trt.runtime.interfaces import BackendDefaults
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.runtime.snapshot import SnapshotError, SnapshotMismatch, read_meta
from dflash_trt.tools.tiny import KERNEL_SHAPES, make_tiny_pair

TESTS = os.path.dirname(os.path.abspath(__file__))
SIZES = PoolSizes(kv_blocks=64, page_size=4, max_seq_len=256, max_seqs=2, dkv_blocks=64, ctx_window=12,
                  prefill_chunk=16)
N_NEW = 60
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 250, 23)]
OTHER = [int(t) for t in np.random.default_rng(1).integers(0, 250, 17)]
# name -> (mode, gamma, steps before the save, device that saves)
CASES = {"spec3": ("spec", 3, 5, "host"), "spec15": ("spec", 15, 4, "host"), "plain": ("plain", 0, 7, "host"),
         "torch_pools": ("spec", 3, 5, "torch-cpu")}


class Recorder(BackendDefaults):
    """Backend wrapper that logs what the real drafter proposed at each drafter_block launch."""

    def __init__(self, inner):
        self.inner, self.name, self.kv_dtype = inner, inner.name, inner.kv_dtype
        self.drafts = []

    def run(self, graph, inputs):
        out = self.inner.run(graph, inputs)
        if graph.startswith(DRAFTER_BLOCK):  # drafter_block or drafter_block_b{γ+1}
            self.drafts.append(np.asarray(out["drafts"]).tolist())
        return out


def load_pair(dirs, device="cpu", dtype=torch.float32):
    t = load_target(dirs[0], dtype).to(device)
    return t, load_drafter(dirs[1], t, dtype).to(device)


def make_device(kind):
    return {"host": HostDevice, "torch-cpu": lambda: TorchDevice("cpu"), "cuda": lambda: TorchDevice("cuda")}[kind]()


def make_runtime(pair, full, device="host", step0=0, sizes=SIZES):
    """Runtime over Recorder(TorchBackend) inside ScriptedDrafter (its step counter resumes at step0)."""
    rec = Recorder(TorchBackend(*pair))
    be = ScriptedDrafter(rec, full, pair[0].cfg.vocab_size, lambda s, g: s % (g + 1))
    be.step = step0
    return Runtime(be, pair[0].cfg, pair[1].cfg, sizes, device=make_device(device)), rec


def step(rt, seq, mode, gamma):
    """One step of either kind; returns (new tokens, accepted drafts or None)."""
    if mode == "spec":
        toks, acc = rt.spec_step([seq], gamma)
        return toks[0], acc[0]
    return rt.decode_step([seq])[0], None


def drive(rt, seq, mode, gamma, new, until=None, steps=None):
    """Step until len(new) >= until (or `steps` steps); extends `new`, returns the accepted counts."""
    accepted = []
    while (steps is None or len(accepted) < steps) and (until is None or len(new) < until):
        toks, acc = step(rt, seq, mode, gamma)
        new.extend(toks)
        accepted.append(acc)
    return accepted


def free_counts(rt):
    return rt.kv_alloc.num_free, rt.dkv_alloc.num_free, rt.slots.num_free


def child_main(job_path):
    """Runs in a fresh interpreter: load the pair, restore every job's snapshot, continue, write results."""
    with open(job_path) as f:
        job = json.load(f)
    pair = load_pair(job["dirs"], "cuda" if job["device"] == "cuda" else "cpu")
    res = {}
    for j in job["jobs"]:
        mode, gamma = j["mode"], j["gamma"]
        rt, rec = make_runtime(pair, j["full"], j["device"], step0=j["step0"])
        other = other_new = None
        if j.get("other_steps") is not None:  # a live sequence already holds slot, pages and ctx pages
            other = rt.add_sequence(OTHER)
            rt.prefill(other)
            other_new = [other.bonus]
            drive(rt, other, "plain", 0, other_new, steps=j["other_steps"])
        seq = rt.restore_sequence(j["snapshot"])
        new = list(read_meta(j["snapshot"])["extra"]["new"])
        accepted = []
        while len(new) < N_NEW:
            if other is not None:  # interleave: both sequences grow their page lists in turn
                other_new.extend(rt.decode_step([other])[0])
            toks, acc = step(rt, seq, mode, gamma)
            new.extend(toks)
            accepted.append(acc)
        for s in (seq, other):
            if s is not None:
                rt.release(s)
        res[j["name"]] = {"new": new[:N_NEW], "accepted": accepted, "drafts": rec.drafts,
                          "other_new": other_new, "free": list(free_counts(rt)),
                          "total": [rt.kv_alloc.num_total, rt.dkv_alloc.num_total, rt.slots.num_total]}
    with open(job["out"], "w") as f:
        json.dump(res, f)


def run_child(tmp, dirs, device, jobs):
    job_path, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
    with open(job_path, "w") as f:
        json.dump({"dirs": list(dirs), "device": device, "jobs": jobs, "out": out}, f)
    p = subprocess.run([sys.executable, "-c", "import sys, test_save_restore as t; t.child_main(sys.argv[1])",
                        job_path], cwd=TESTS, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def uninterrupted(pair, full, mode, gamma, device="host"):
    rt, rec = make_runtime(pair, full, device)
    seq = rt.add_sequence(PROMPT)
    rt.prefill(seq)
    new = [seq.bonus]
    acc = drive(rt, seq, mode, gamma, new, until=N_NEW)
    rt.release(seq)
    return {"new": new[:N_NEW], "accepted": acc, "drafts": rec.drafts}


def save_after(pair, full, mode, gamma, k, path, device="host"):
    """Run k steps, save; returns (runtime, live sequence) so tests can compare state."""
    rt, _ = make_runtime(pair, full, device)
    seq = rt.add_sequence(PROMPT)
    rt.prefill(seq)
    new = [seq.bonus]
    drive(rt, seq, mode, gamma, new, steps=k)
    rt.save_sequence(seq, path, extra={"new": new})
    return rt, seq


def greedy_full(pair, prompt=PROMPT, n=120, device="host"):
    rt = Runtime(TorchBackend(*pair), pair[0].cfg, pair[1].cfg, SIZES, device=make_device(device))
    return list(prompt) + rt.generate(prompt, n, spec=False)[0]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)


@pytest.fixture(scope="module")
def pair(dirs):
    return load_pair(dirs)


@pytest.fixture(scope="module")
def full(pair):
    return greedy_full(pair)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dirs, pair, full):
    """Every case: the uninterrupted oracle, and the continuation after save -> restore in ONE child process."""
    tmp = str(tmp_path_factory.mktemp("snap"))
    oracle, jobs = {}, []
    for name, (mode, gamma, k, dev) in CASES.items():
        oracle[name] = uninterrupted(pair, full, mode, gamma, dev)
        snap = os.path.join(tmp, name)
        save_after(pair, full, mode, gamma, k, snap, dev)
        # torch_pools: saved from torch-tensor pools, restored into numpy pools (snapshots are host data)
        jobs.append({"name": name, "snapshot": snap, "mode": mode, "gamma": gamma, "full": full,
                     "step0": k if mode == "spec" else 0, "device": "host"})
    jobs.append(dict(jobs[0], name="shared", other_steps=6))
    oracle["shared"] = oracle["spec3"]
    got = run_child(tmp, dirs, "host", jobs)
    return oracle, got, greedy_full(pair, OTHER)


@pytest.mark.parametrize("name", ["spec3", "spec15", "plain", "torch_pools", "shared"])
def test_restored_in_new_process_continues_identically(runs, name):
    oracle, got, _ = runs
    mode, gamma, k, _ = CASES["spec3" if name == "shared" else name]
    o, g = oracle[name], got[name]
    assert g["new"] == o["new"]
    assert g["accepted"] == o["accepted"][k:]  # same step schedule after the save
    if name != "torch_pools":  # commit numerics differ in the last bits between numpy and torch pools
        assert g["drafts"] == o["drafts"][k:]  # the real drafter saw the same ctx rows
    assert g["free"] == g["total"]  # everything restored was given back on release
    if mode == "spec":
        assert len(g["drafts"]) == len(g["accepted"]) > 2


def test_live_sequence_keeps_generating_identically(runs):
    _, got, other_full = runs
    other = got["shared"]["other_new"]
    assert len(other) > 15 and other == other_full[len(OTHER):len(OTHER) + len(other)]


def gather_state(rt, seq):
    dev, c = rt.device, seq.ctx
    return {"kv": dev.gather_rows(rt.pools["kv_pool"], seq.block_table(), 0, seq.seq_len),
            "gdn": dev.to_host(rt.pools["gdn_pool"][:, seq.slot]),
            "conv": dev.to_host(rt.pools["conv_pool"][:, seq.slot]),
            "ctx": dev.gather_rows(rt.pools["dkv_pool"], c.block_table(), c.start, c.end - c.start),
            "book": (seq.tokens, seq.bonus, seq.seq_len, c.start, c.end, c.total, len(c.pages),
                     c.positions_visible().tolist())}


@pytest.mark.parametrize("src,dst", [("host", "torch-cpu"), ("torch-cpu", "host"), ("host", "host")])
def test_restored_state_is_bitwise_the_saved_state(tmp_path, pair, full, src, dst):
    rt, seq = save_after(pair, full, "spec", 3, 5, str(tmp_path / "s"), src)
    assert seq.ctx.start > 0 or seq.seq_len > 2 * SIZES.ctx_window  # the window has slid
    rt2, _ = make_runtime(pair, full, dst)
    busy = rt2.add_sequence(OTHER)  # so the restored rows land in other pages and another slot
    rt2.prefill(busy)
    seq2 = rt2.restore_sequence(str(tmp_path / "s"))
    assert seq2.slot != busy.slot and not set(seq2.pages) & set(busy.pages)
    a, b = gather_state(rt, seq), gather_state(rt2, seq2)
    assert a["book"] == b["book"]
    for k in ("kv", "gdn", "conv", "ctx"):
        assert np.array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)), k


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, pair, full):
    path = str(tmp_path_factory.mktemp("one") / "snap")
    save_after(pair, full, "spec", 3, 5, path)
    return path


def refuse(rt, path, exc, *words):
    before = free_counts(rt)
    with pytest.raises(exc) as e:
        rt.restore_sequence(path)
    assert free_counts(rt) == before  # nothing allocated, nothing leaked
    for w in words:
        assert w in str(e.value), str(e.value)
    return e.value


def test_mismatched_runtime_refused_naming_the_field(tmp_path, dirs, pair, full, snapshot):
    import dataclasses

    rt, _ = make_runtime(pair, full, sizes=dataclasses.replace(SIZES, ctx_window=16))
    refuse(rt, snapshot, SnapshotMismatch, "sizes.ctx_window", "file 12", "this runtime 16")
    other = load_pair(make_tiny_pair(str(tmp_path / "p4"), seed=4))  # same config, other weights
    rt, _ = make_runtime(other, full)
    e = refuse(rt, snapshot, SnapshotMismatch, "weights.target", "weights.drafter")
    assert not [f for f in e.fields if f.startswith(("target.", "sizes."))]
    rt, _ = make_runtime(load_pair(dirs, dtype=torch.float64), full)
    refuse(rt, snapshot, SnapshotMismatch, "kv_dtype", "'float32'", "'float64'")
    plain = Runtime(TorchBackend(pair[0]), pair[0].cfg, None, SIZES)
    refuse(plain, snapshot, SnapshotMismatch, "drafter: file True, this runtime False")
    # capacities are not identity: a runtime with bigger pools takes the sequence
    rt, _ = make_runtime(pair, full, sizes=dataclasses.replace(SIZES, kv_blocks=80, max_seqs=3))
    rt.release(rt.restore_sequence(snapshot))


def _edit(src, dst, meta_fn=None, state_fn=None):
    import shutil

    shutil.copytree(src, dst)
    if meta_fn:
        p = os.path.join(dst, "meta.json")
        m = json.load(open(p))
        meta_fn(m)
        json.dump(m, open(p, "w"))
    if state_fn:
        p = os.path.join(dst, "state.safetensors")
        data = bytearray(open(p, "rb").read())
        open(p, "wb").write(state_fn(data))
    return str(dst)


def test_corrupt_or_missing_files_clear_error_nothing_allocated(tmp_path, pair, full, snapshot):
    rt, _ = make_runtime(pair, full)
    live = rt.add_sequence(OTHER)  # pools partly used: the failed restores must not touch its share
    rt.prefill(live)

    def flip(d):
        d[-5] ^= 0xFF
        return bytes(d)

    refuse(rt, str(tmp_path / "nope"), SnapshotError, "no snapshot directory")
    refuse(rt, _edit(snapshot, tmp_path / "a", state_fn=flip), SnapshotError, "corrupt", "sha256")
    refuse(rt, _edit(snapshot, tmp_path / "b", state_fn=lambda d: bytes(d[:100])), SnapshotError, "sha256")
    p = _edit(snapshot, tmp_path / "c")
    os.remove(os.path.join(p, "state.safetensors"))
    refuse(rt, p, SnapshotError, "state.safetensors missing")
    p = _edit(snapshot, tmp_path / "d")
    open(os.path.join(p, "meta.json"), "w").write('{"format": "dflash-trt-seq')
    refuse(rt, p, SnapshotError, "meta.json", "not valid JSON")
    refuse(rt, _edit(snapshot, tmp_path / "e", lambda m: m["ctx"].update(start=m["ctx"]["start"] + 1)),
           SnapshotError, "corrupt", "ctx")
    refuse(rt, _edit(snapshot, tmp_path / "f", lambda m: m["seq"].update(seq_len=999)), SnapshotError, "seq_len")
    refuse(rt, _edit(snapshot, tmp_path / "g", lambda m: m.update(version=99)), SnapshotError, "version 99")
    # a valid snapshot still restores into the same runtime afterwards
    rt.release(rt.restore_sequence(snapshot))
    rt.release(live)
    assert free_counts(rt) == (rt.kv_alloc.num_total, rt.dkv_alloc.num_total, rt.slots.num_total)


def test_restore_without_room_is_all_or_nothing(pair, full, snapshot):
    rt, _ = make_runtime(pair, full)
    held = rt.dkv_alloc.alloc(rt.dkv_alloc.num_free - 1)  # slot and KV pages fit, ctx pages do not
    refuse(rt, snapshot, PoolExhausted, "drafter ctx pages")
    rt.dkv_alloc.free(held)
    rt.release(rt.restore_sequence(snapshot))


def test_save_replaces_atomically_and_refuses_foreign_paths(tmp_path, pair, full):
    path = str(tmp_path / "s")
    rt, seq = save_after(pair, full, "plain", 0, 2, path)
    drive(rt, seq, "plain", 0, [], steps=3)
    rt.save_sequence(seq, path)  # overwrite with the later state
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no temp or old directory left behind
    assert read_meta(path)["seq"]["seq_len"] == seq.seq_len
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SnapshotError, match="file: exists and is not a directory; refusing to overwrite it"):
        rt.save_sequence(seq, str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "mine"
    seq.pages.extend(rt.kv_alloc.alloc(1))  # what a step in flight holds: a reservation past seq_len
    with pytest.raises(SnapshotError, match="in flight"):
        rt.save_sequence(seq, path)
    assert read_meta(path)["seq"]["seq_len"] == seq.seq_len  # the previous snapshot is untouched
    rt.release(seq)
    with pytest.raises(SnapshotError, match="released"):
        rt.save_sequence(seq, path)


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("k")), seed=5, **KERNEL_SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,gamma,k", [("spec", 3, 5), ("spec", 15, 4), ("plain", 0, 7)])
def test_gpu_save_restore_new_process(tmp_path, kernel_dirs, mode, gamma, k):
    """TorchDevice('cuda') pools: save after k steps, restore in a new process on the GPU, continue."""
    gp = load_pair(kernel_dirs, "cuda")
    full = greedy_full(gp, device="cuda")
    oracle = uninterrupted(gp, full, mode, gamma, "cuda")
    rt, seq = save_after(gp, full, mode, gamma, k, str(tmp_path / "s"), "cuda")
    rt2, _ = make_runtime(gp, full, "cuda")  # in-process: state bitwise equal on the device too
    a, b = gather_state(rt, seq), gather_state(rt2, rt2.restore_sequence(str(tmp_path / "s")))
    assert a["book"] == b["book"] and all(np.array_equal(a[x], b[x]) for x in ("kv", "gdn", "conv", "ctx"))
    job = {"name": "g", "snapshot": str(tmp_path / "s"), "mode": mode, "gamma": gamma, "full": full,
           "step0": k if mode == "spec" else 0, "device": "cuda"}
    g = run_child(str(tmp_path), kernel_dirs, "cuda", [job])["g"]
    assert g["new"] == oracle["new"] and g["accepted"] == oracle["accepted"][k:]
    assert g["drafts"] == oracle["drafts"][k:] and g["free"] == g["total"]
