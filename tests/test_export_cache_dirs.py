"""A cache hit whose recorded checkpoint folder is gone (the entry was exported from another copy of the same
weights) records the caller's folder, so `compare` and rebuilds find the checkpoints."""
import os
import shutil

from dflash_trt.export.onnx_export import ensure_export
from dflash_trt.manifest import Manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


def test_a_hit_from_a_vanished_copy_records_the_callers_dirs(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(MODELS, copy)
    cache = str(tmp_path / "cache")
    first = ensure_export(str(copy / "target"), str(copy / "drafter"), ks=[1], cache_dir=cache, progress=None)
    assert Manifest.load(first).data["target"]["dir"] == str(copy / "target")
    shutil.rmtree(copy)
    again = ensure_export(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), ks=[1], cache_dir=cache,
                          progress=None)
    assert again == first
    data = Manifest.load(again).data
    assert data["target"]["dir"] == os.path.join(MODELS, "target")
    assert data["drafter"]["dir"] == os.path.join(MODELS, "drafter")
    assert ensure_export(os.path.join(MODELS, "target"), os.path.join(MODELS, "drafter"), ks=[1], cache_dir=cache,
                         progress=None) == first  # still a valid hit after the record changed
