"""Save / restore one sequence's decoding state, on every device.

A snapshot is a DIRECTORY holding two files:
  meta.json          format/version, the runtime identity (field -> value, the weights' checkpoint hashes
                     included) and its sha256, the sequence bookkeeping (tokens, bonus, seq_len, page counts,
                     CtxWindow start/end/total), the sha256 of state.safetensors, optional caller data
                     (`extra`), and field_sha256 over all of these: an edited field is refused, not decoded.
  state.safetensors  the sequence's rows only (never a whole pool), as host arrays:
                     kv [La,2,seq_len,Hkv,hd]   target K/V rows 0..seq_len-1 in logical order
                     gdn [Lg,Hv,dk,dv]          its GDN state slot;  conv [Lg,C,W-1] its conv slot
                     ctx_kv [Ld,2,held,H,hd]    drafter ctx rows [start, end) of its CtxWindow
                     ctx_pos [held] int64       their absolute positions (kept, never recomputed)
No pickle anywhere. Rows are stored in logical order, so restore may place them in any free pages:
page ids are an allocator detail of the saving process. The ctx rows keep their in-page offset
(`start`), so the window slides at exactly the same steps as in the uninterrupted run.

Writes are atomic: both files (and dflash-trt's ownership marker, dflash_trt.owned) go into a sibling
temp directory that is renamed over `path`; the sha256 in meta.json binds the pair, so a torn or edited
state file is detected, not decoded. Only an empty or missing directory, or a snapshot this product wrote
(its marker lists everything in it), is ever replaced: anything else is refused before a byte is written.
Restore validates everything (identity, hashes, shapes, bookkeeping) BEFORE it allocates; then it
takes a slot and pages from the runtime's allocators and gives all of them back if anything fails.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from dflash_trt.owned import check_replaceable, staged_dir
from dflash_trt.plugins.opspec import dtype_name
from dflash_trt.runtime.commit import cdiv
from dflash_trt.runtime.sequence import Sequence

FORMAT = "dflash-trt-sequence"
KIND = "snapshot"  # the ownership marker's kind (dflash_trt.owned)
VERSION = 2  # 2: field_sha256 covers every field of meta.json
META, STATE = "meta.json", "state.safetensors"
# PoolSizes fields that shape a sequence's state or its graphs' static dims; pool capacities
# (kv_blocks, dkv_blocks, max_seqs) are not identity: a bigger or busier runtime may take the sequence,
# and one without room fails with the allocator's PoolExhausted.
_SIZE_FIELDS = ("page_size", "max_seq_len", "ctx_window", "prefill_chunk")


class SnapshotError(ValueError):
    """A snapshot is missing, unreadable, corrupt, or cannot be taken."""


class SnapshotMismatch(SnapshotError):
    """A snapshot was written by a runtime with another model / config / sizes; `.fields` lists them."""

    def __init__(self, path: str, fields: list[str]):
        self.fields = fields
        shown = "; ".join(fields[:6]) + (f"; ... and {len(fields) - 6} more" if len(fields) > 6 else "")
        super().__init__(f"{path}: snapshot is from another model/config, refusing to restore: {shown}")


def identity(rt) -> dict:
    """field -> JSON value: everything a sequence's state depends on (flat, so a mismatch names a field)."""
    out = {f"target.{k}": v for k, v in asdict(rt.tcfg).items()}
    out["drafter"] = rt.dcfg is not None
    if rt.dcfg is not None:
        out.update({f"drafter.{k}": v for k, v in asdict(rt.dcfg).items()})
    out["kv_dtype"] = str(rt.backend.kv_dtype)
    out.update({f"pool.{name}.dtype": dtype_name(p.dtype) for name, p in sorted(rt.pools.items())})
    out.update({f"sizes.{k}": getattr(rt.sizes, k) for k in _SIZE_FIELDS})
    out["weights.target"] = rt.backend.weights_id("target")
    out["weights.drafter"] = rt.backend.weights_id("drafter") if rt.dcfg is not None else None
    return json.loads(json.dumps(out))  # JSON-normalised (tuples -> lists), as it will read back


def _hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _field_hashes(meta: dict) -> dict:
    """field -> sha256 (16 hex) of its JSON value, as it reads back, for every meta.json field but this map;
    dict fields per key (seq.tokens, seq.bonus, ctx.start, identity.weights.target, ...), so a refusal names the
    edited one. Covers what a continuation starts from and the caller's `extra`, which the caller resumes from.
    It detects edits and damage; it is no signature (there is no secret)."""
    flat = {}
    for k, v in json.loads(json.dumps(meta)).items():
        if k == "field_sha256":
            continue
        flat.update({f"{k}.{sk}": sv for sk, sv in v.items()} if isinstance(v, dict) and k != "extra" else {k: v})
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in flat.items()}


def _diff(saved: dict, now: dict) -> list[str]:
    out = []
    same_drafter = saved.get("drafter") == now.get("drafter")
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, "(absent)"), now.get(k, "(absent)")
        if k.startswith(("drafter.", "weights.drafter")) and not same_drafter:
            continue  # 'drafter: True vs False' says it; its fields would only repeat it
        if k.startswith("weights.") and (a is None or b is None) and (k == "weights.target" or now.get("drafter")):
            out.append(f"{k}: the weights cannot be identified (file {a!r}, this runtime {b!r})")
        elif a != b:
            kinds = k.startswith("weights.") and str(a).split(":")[0] != str(b).split(":")[0]
            out.append(f"{k}: file {a!r}, this runtime {b!r}" + (" (a checkpoint hash and a parameter hash: "
                                                                 "the same weights cannot be shown)" if kinds else ""))
    return out


# ---- save -------------------------------------------------------------------------------
def save_sequence(rt, seq: Sequence, path: str, extra: dict | None = None) -> str:
    """Write `seq`'s state to the snapshot directory `path` (replaced atomically if it is one).
    `extra`: JSON-serialisable caller data (e.g. the tokens generated so far), see read_meta()."""
    if seq.slot < 0:
        raise SnapshotError(f"sequence {seq.seq_id} was released; nothing to save")
    if seq.bonus is None:
        raise SnapshotError(f"sequence {seq.seq_id} has not been prefilled; save after prefill")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"{path}: extra is not JSON-serialisable ({e}); nothing written") from None
    check_replaceable(os.path.abspath(path), KIND, SnapshotError)  # before the device copies below
    if len(seq.pages) > cdiv(seq.seq_len, rt.sizes.page_size):
        # pages past seq_len are a reservation for a step still in flight (GPU executor): the device
        # is ahead of seq_len and the host state is not the state a restore would continue from
        raise SnapshotError(f"sequence {seq.seq_id} has a step in flight (pages reserved past seq_len "
                            f"{seq.seq_len}); save between steps")
    dev = rt.device
    tensors = {
        "kv": dev.gather_rows(rt.pools["kv_pool"], seq.block_table(), 0, seq.seq_len),
        "gdn": dev.to_host(rt.pools["gdn_pool"][:, seq.slot]),
        "conv": dev.to_host(rt.pools["conv_pool"][:, seq.slot]),
    }
    ctx = None
    if seq.ctx is not None:
        c = seq.ctx
        held = c.end - c.start
        tensors["ctx_kv"] = dev.gather_rows(rt.pools["dkv_pool"], c.block_table(), c.start, held)
        # every held row's position, not only the visible window's (positions_visible)
        tensors["ctx_pos"] = c.positions_held()
        ctx = {"start": c.start, "end": c.end, "total": c.total, "pages": len(c.pages)}
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    blob = st_save(tensors)
    ident = identity(rt)
    meta = {
        "format": FORMAT, "version": VERSION, "identity": ident, "identity_sha256": _hash(ident),
        "state_sha256": hashlib.sha256(blob).hexdigest(),
        "seq": {"tokens": [int(t) for t in seq.tokens], "bonus": int(seq.bonus), "seq_len": int(seq.seq_len),
                "saved_seq_id": seq.seq_id},
        "ctx": ctx,
        "saved_by": {"device": dev.name, "backend": rt.backend.name},
        "extra": extra_json,
    }
    meta["field_sha256"] = _field_hashes(meta)
    _write_atomic(path, json.dumps(meta, indent=1).encode(), blob)
    return path


def _write_file(p: str, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: str, meta: bytes, blob: bytes) -> None:
    path = os.path.abspath(path)
    try:
        with staged_dir(path, KIND, SnapshotError) as tmp:  # same filesystem, so the rename is atomic
            _write_file(os.path.join(tmp, STATE), blob)
            _write_file(os.path.join(tmp, META), meta)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot write the snapshot: {e.strerror or e}") from None


# ---- read + validate (no allocation) ------------------------------------------------------
def read_meta(path: str) -> dict:
    """meta.json of a snapshot, format-checked (its 'extra' is the caller data given to save)."""
    p = os.path.join(path, META)
    if not os.path.isdir(path):
        raise SnapshotError(f"{path}: no snapshot directory there")
    try:
        with open(p, "rb") as f:
            meta = json.loads(f.read().decode())
    except FileNotFoundError:
        raise SnapshotError(f"{path}: not a snapshot ({META} missing)") from None
    except OSError as e:  # e.g. meta.json is a directory
        raise SnapshotError(f"{p}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{p}: corrupt, not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotError(f"{p}: not a {FORMAT} snapshot")
    if meta.get("version") != VERSION:
        raise SnapshotError(f"{p}: snapshot version {meta.get('version')!r}, this runtime reads version {VERSION}")
    for k in ("identity", "identity_sha256", "state_sha256", "seq", "ctx", "field_sha256"):
        if k not in meta:
            raise SnapshotError(f"{p}: corrupt, field '{k}' missing")
    saved = meta["field_sha256"] if isinstance(meta["field_sha256"], dict) else {}
    now = _field_hashes(meta)
    bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise SnapshotError(f"{p}: corrupt or edited, {shown} not as saved (sha256 differs from field_sha256)")
    return meta


def _int(v, what: str, lo: int, hi: int, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SnapshotError(f"{path}: corrupt, {what}={v!r} not an integer in [{lo}, {hi}]")
    return v


def _load_checked(rt, path: str) -> tuple[dict, dict]:
    """(meta, host arrays) after every check a restore needs; raises SnapshotError, allocates nothing."""
    meta = read_meta(path)
    # compared field by field, not by identity_sha256: fields that cannot be identified (None) never match
    diff = _diff(meta["identity"] if isinstance(meta["identity"], dict) else {}, identity(rt))
    if diff:
        raise SnapshotMismatch(path, diff)
    sp = os.path.join(path, STATE)
    try:
        with open(sp, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise SnapshotError(f"{path}: incomplete snapshot ({STATE} missing)") from None
    except OSError as e:  # a directory, no permission, an I/O error: one line, not a traceback
        raise SnapshotError(f"{sp}: cannot be read ({e.strerror})") from None
    if hashlib.sha256(blob).hexdigest() != meta["state_sha256"]:
        raise SnapshotError(f"{sp}: corrupt (sha256 differs from the one recorded in {META})")
    try:
        arrays = st_load(blob)
    except (SafetensorError, ValueError) as e:
        raise SnapshotError(f"{sp}: corrupt, not readable as safetensors ({e})") from None

    s, sz = meta["seq"], rt.sizes
    if not isinstance(s, dict) or not isinstance(s.get("tokens"), list) or not s["tokens"]:
        raise SnapshotError(f"{path}: corrupt, seq.tokens missing or empty")
    V = rt.tcfg.vocab_size
    for t in s["tokens"]:
        _int(t, "token", 0, V - 1, path)
    _int(s.get("bonus"), "bonus", 0, V - 1, path)
    seq_len = _int(s.get("seq_len"), "seq_len", len(s["tokens"]), sz.max_seq_len, path)
    want = {
        "kv": rt.pools["kv_pool"].shape[:2] + (seq_len,) + rt.pools["kv_pool"].shape[4:],
        "gdn": rt.pools["gdn_pool"].shape[:1] + rt.pools["gdn_pool"].shape[2:],
        "conv": rt.pools["conv_pool"].shape[:1] + rt.pools["conv_pool"].shape[2:],
    }
    c = meta["ctx"]
    if (c is None) != (rt.dcfg is None):
        raise SnapshotError(f"{path}: corrupt, drafter ctx {'missing' if c is None else 'present'} "
                            f"but the runtime {'has' if rt.dcfg is not None else 'has no'} drafter")
    if c is not None:
        ps = sz.page_size
        start = _int(c.get("start"), "ctx.start", 0, ps - 1, path)
        end = _int(c.get("end"), "ctx.end", start, 1 << 40, path)
        # the window's page-table width depends on the runtime's executor (rows reserved ahead)
        _int(c.get("pages"), "ctx.pages", cdiv(end, ps), rt.ctx_blocks, path)
        total = _int(c.get("total"), "ctx.total", 0, 1 << 40, path)
        held = end - start
        # DESIGN §5 invariant: every committed position was appended once; the held rows end at
        # seq_len - 1 and include the visible window.
        if total != seq_len or held < min(total, sz.ctx_window):
            raise SnapshotError(f"{path}: corrupt, ctx total={total} held={held} do not fit seq_len={seq_len}")
        pos = arrays.get("ctx_pos")
        if pos is None or pos.shape != (held,) or not np.array_equal(pos, np.arange(seq_len - held, seq_len)):
            raise SnapshotError(f"{path}: corrupt, ctx positions are not {held} contiguous rows "
                                f"ending at {seq_len - 1}")
        d = rt.pools["dkv_pool"].shape
        want["ctx_kv"], want["ctx_pos"] = d[:2] + (held,) + d[4:], (held,)
    if set(arrays) != set(want):
        raise SnapshotError(f"{sp}: corrupt, tensors {sorted(arrays)} but expected {sorted(want)}")
    for k, shape in want.items():
        if tuple(arrays[k].shape) != tuple(shape):
            raise SnapshotError(f"{sp}: corrupt, tensor '{k}' has shape {list(arrays[k].shape)}, "
                                f"expected {list(shape)}")
    return meta, arrays


# ---- restore ------------------------------------------------------------------------------
def _put(rt, pool, index: tuple, value: np.ndarray) -> None:
    """pool[index] = value, in place, for numpy pools and torch pools (any device) alike."""
    v = rt.device.from_host(value)
    if isinstance(pool, np.ndarray):
        pool[index] = np.asarray(v).astype(pool.dtype, copy=False)
        return
    import torch  # only reached when the device keeps its pools as torch tensors

    idx = tuple(torch.as_tensor(i, device=pool.device) if isinstance(i, np.ndarray) else i for i in index)
    pool[idx] = torch.as_tensor(v).to(pool.device, pool.dtype)


def _put_rows(rt, pool, rows: np.ndarray, pages: list[int], start: int) -> None:
    """Write rows [L,2,n,H,hd] to logical rows start..start+n-1 of the page list `pages`."""
    n = rows.shape[2]
    if n == 0:
        return
    logical = start + np.arange(n, dtype=np.int64)
    ps = pool.shape[3]
    _put(rt, pool, (slice(None), slice(None), np.asarray(pages, dtype=np.int64)[logical // ps], logical % ps), rows)


def restore_sequence(rt, path: str) -> Sequence:
    """A live Sequence of `rt` (fresh id, slot and pages) in exactly the saved state: the next
    decode/spec step continues token-identically. All-or-nothing on the allocators."""
    meta, a = _load_checked(rt, path)
    s, c = meta["seq"], meta["ctx"]
    seq = rt.add_sequence(s["tokens"])  # slot + zeroed state + an empty CtxWindow of this runtime's sizes
    rt.executor.settle()  # the zeroing lands before the writes below
    try:
        seq.pages = rt.kv_alloc.alloc(cdiv(s["seq_len"], rt.sizes.page_size))
        if c is not None:
            seq.ctx.pages = seq.ctx.allocator.alloc(c["pages"])
        _put_rows(rt, rt.pools["kv_pool"], a["kv"], seq.pages, 0)
        _put(rt, rt.pools["gdn_pool"], (slice(None), seq.slot), a["gdn"])
        _put(rt, rt.pools["conv_pool"], (slice(None), seq.slot), a["conv"])
        if c is not None:
            _put_rows(rt, rt.pools["dkv_pool"], a["ctx_kv"], seq.ctx.pages, c["start"])
            # CtxWindow has no public way to adopt held rows; its fields are set as finish_append would
            seq.ctx.start, seq.ctx.end, seq.ctx.total = c["start"], c["end"], c["total"]
            seq.ctx._last = int(a["ctx_pos"][-1]) if a["ctx_pos"].size else None  # checked on load
    except BaseException:
        rt.release(seq)  # gives back the slot, the KV pages and the ctx pages taken above
        raise
    seq.seq_len, seq.bonus = s["seq_len"], s["bonus"]
    return seq
