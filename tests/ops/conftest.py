"""Op tests: print the GPU kernels' max errors (op_helpers.ERRS) once at the end of the session."""
import json
import os

import pytest

import op_helpers


@pytest.fixture(scope="session", autouse=True)
def _kernel_errors():
    yield
    if not op_helpers.ERRS:
        return
    print("\nKERNEL MAX ERRORS (max|got-ref| / max|ref|):")
    for k in sorted(op_helpers.ERRS):
        print(f"  {k:40s} {op_helpers.ERRS[k]:.3e}")
    path = os.environ.get("DFLASH_KERNEL_ERRS")
    if path:
        with open(path, "w") as f:
            json.dump(op_helpers.ERRS, f, indent=1, sort_keys=True)
