"""Package discovery for the source folders mapped into dflash_trt (the rest of the metadata is pyproject.toml):
every folder with an __init__.py under a mapped root is a subpackage, and every plugins/ package ships its CUDA
sources (NVRTC compiles them at run time), so a new op folder needs no packaging edit."""
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = {"dflash_trt": "dflash_trt", "dflash_trt.export": "export", "dflash_trt.modeling": "modeling", "dflash_trt.plugins": "plugins",
               "dflash_trt.engines": "engines", "dflash_trt.runtime": "runtime", "dflash_trt.tools": "tools"}
KERNEL_SOURCES = ["*.cu", "*.cuh"]


def packages(root: str = HERE) -> list:
    """Every package under the mapped folders of `root` (a folder without __init__.py ends its branch)."""
    found = []
    for pkg, folder in PACKAGE_DIR.items():
        base = os.path.join(root, folder)
        for dirpath, dirs, files in os.walk(base):
            if "__init__.py" not in files:
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(dirpath, base)
            found.append(pkg if rel == "." else f"{pkg}.{rel.replace(os.sep, '.')}")
    return sorted(found)


def package_data(root: str = HERE) -> dict:
    return {p: KERNEL_SOURCES for p in packages(root) if p.split(".")[:2] == ["dflash_trt", "plugins"]}


if __name__ == "__main__":
    setup(package_dir=PACKAGE_DIR, packages=packages(), package_data=package_data())
