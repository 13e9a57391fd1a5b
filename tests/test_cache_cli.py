"""`dflash-trt cache list|clear`: lists the export entries, frees ours, and leaves alone anything dflash-trt did
not write (a user's folder named like an entry, a file put into an entry, files in nvrtc/ of other names)."""
import os

from dflash_trt.cli import main
from dflash_trt.owned import write_marker


def _entry(root, name, files, kind="export"):
    d = root / name
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"x" * 1000)
    write_marker(str(d), kind, files)
    return d


def test_list_and_clear_free_only_what_dflash_trt_wrote(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(root))
    ours = _entry(root, "onnx-0123456789abcdef", ["target_k1.onnx", "manifest.json"])
    touched = _entry(root, "onnx-00000000000000aa", ["target_k1.onnx"])
    (touched / "my_notes.txt").write_text("mine")  # a user's file inside an entry: the entry stays
    mine = root / "onnx-mine"
    mine.mkdir()
    (mine / "data.csv").write_text("1,2")  # a user's folder with the entries' prefix, no marker
    nv = root / "nvrtc"
    nv.mkdir()
    (nv / "gemv-sm_90-0123456789abcdef0123456789abcdef.cubin").write_bytes(b"k" * 10)
    (nv / "README").write_text("user")

    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "onnx-0123456789abcdef" in out and "onnx-00000000000000aa" in out and "onnx-mine" not in out
    assert "unreadable manifest" in out and "nvrtc: 1 compiled kernels" in out and "2 exports" in out

    assert main(["cache", "clear", "onnx-mine"]) == 2
    assert "not an export entry" in capsys.readouterr().err and (mine / "data.csv").exists()

    assert main(["cache", "clear"]) == 2  # the touched entry is left alone, and said so
    err = capsys.readouterr().err
    assert "my_notes.txt" in err and "freed" in err
    assert not ours.exists() and (touched / "my_notes.txt").exists() and (touched / "target_k1.onnx").exists()
    assert (mine / "data.csv").exists() and (nv / "README").exists()
    assert not (nv / "gemv-sm_90-0123456789abcdef0123456789abcdef.cubin").exists()


def test_the_compiled_steps_cache_is_listed_and_cleared_only_when_ours(tmp_path, monkeypatch, capsys):
    """The Inductor directory our compiled steps create (with its marker) is listed and freed; a user's own folder
    of that name is left alone."""
    from dflash_trt.runtime.backends import step_store, torch_compile
    from dflash_trt.runtime.backends.torch_compile import use_cache_dir
    from dflash_trt.tools.cache import STEP_DIRS

    # the cache CLI repeats the directories' names and kinds (it imports no torch): they must be the writers'
    assert [d[:2] for d in STEP_DIRS] == [(torch_compile.CACHE_SUBDIR, torch_compile.CACHE_KIND),
                                          (step_store.SUBDIR, step_store.KIND)]

    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ind = use_cache_dir()
    (root / "inductor" / "fxgraph").mkdir()
    (root / "inductor" / "fxgraph" / "entry").write_bytes(b"g" * 2_000_000)
    assert main(["cache", "list"]) == 0
    assert "inductor: Inductor's code for the compiled steps, 1.9 MB" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0 and not os.path.exists(ind)

    mine = root / "inductor"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["cache", "clear"]) == 0 and (mine / "notes.txt").exists()


def test_a_real_export_entry_is_listed_with_its_widths(tmp_path, monkeypatch, capsys):
    from dflash_trt.export.onnx_export import ensure_export
    from dflash_trt.tools.tiny import make_tiny_pair

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    pair = make_tiny_pair(str(tmp_path / "tiny"), seed=0)
    entry = ensure_export(*pair, ks=[1], progress=None)
    assert main(["cache", "list"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if os.path.basename(entry) in x][0]
    assert "K 1, float32, 0 engines, from " + pair[0] + " + " + pair[1] in line
    assert main(["cache", "clear", os.path.basename(entry)]) == 0 and not os.path.exists(entry)
