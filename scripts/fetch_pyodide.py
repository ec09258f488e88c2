"""Fetch Pyodide (CPython compiled to WebAssembly) once, for the website's calculator.

    python scripts/fetch_pyodide.py          # needs the network once; then the site builds offline

Downloads the ``pyodide`` npm package at PYODIDE_VERSION from the npm registry, checks it
against the registry's sha512, and keeps the files the page loads in .cache/pyodide/VERSION/
(``scripts/build_site.py`` copies them into the site, which then runs labkit with no network).
"""
from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYODIDE_VERSION = "0.29.5"
# the registry's dist.integrity of pyodide@0.29.5 (npm view pyodide@0.29.5 dist.integrity)
INTEGRITY = ("sha512-TkYrUv9m8QmfImADKRmpwZulL48E0uUaBSO+dvRQKyAJc0qh9gu7jn8btyHPh3NZm1r2IH2Y"
             "rJhIr7Q2B9urAw==")
URL = f"https://registry.npmjs.org/pyodide/-/pyodide-{PYODIDE_VERSION}.tgz"
# what loadPyodide() reads: the loader, the runtime, the standard library, the package index
FILES = ("pyodide.js", "pyodide.asm.js", "pyodide.asm.wasm", "python_stdlib.zip",
         "pyodide-lock.json")


def folder(root: Path = ROOT) -> Path:
    return root / ".cache" / "pyodide" / PYODIDE_VERSION


def present(root: Path = ROOT) -> bool:
    return all((folder(root) / name).is_file() for name in FILES)


def fetch(root: Path = ROOT) -> Path:
    """The folder holding FILES, downloaded and checked if they are not there yet."""
    out = folder(root)
    if present(root):
        return out
    with urllib.request.urlopen(URL, timeout=120) as response:
        data = response.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != INTEGRITY:
        raise SystemExit(f"{URL}: sha512 {digest} is not the registry's {INTEGRITY}")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in FILES:
            member = tar.extractfile(f"package/{name}")
            (out / name).write_bytes(member.read())
    return out


if __name__ == "__main__":
    where = fetch()
    print(f"Pyodide {PYODIDE_VERSION}: {where}")
    sys.exit(0)
