"""dflash-trt: hybrid GDN/attention LLMs + DFlash speculative decoding as compiled graphs.

The subpackages live in top-level folders of the repository (export/, plugins/, engines/,
runtime/, tools/) and are installed as dflash_trt.export etc. (pyproject package-dir). When the
package is used straight from a source checkout (PYTHONPATH=repo root, as on the GPU machine),
extend __path__ so the same imports resolve to those folders.
"""
import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "runtime")) and _os.path.isfile(
    _os.path.join(_root, "runtime", "__init__.py")
):
    __path__.append(_root)
