"""Checks that the minimum Rust version stated in Cargo.toml (`rust-version`) and README.md
covers every locked dependency: no package in Cargo.lock may declare a newer `rust-version`.
Our own code is held to the same version by clippy's `incompatible_msrv` lint, which reads
the same field. Run from the repository root: `python3 .ci/check_rust_version.py`."""

import json
import subprocess
import sys


def version(text):
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    metadata = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--locked", "--format-version", "1"],
            check=True, capture_output=True, text=True,
        ).stdout
    )
    root = next(p for p in metadata["packages"] if p["id"] in metadata["workspace_members"])
    stated = root["rust_version"]
    failures = [
        f"{p['name']} {p['version']} needs Rust {p['rust_version']}, above rust-version {stated}"
        for p in metadata["packages"]
        if p.get("rust_version") and version(p["rust_version"]) > version(stated)
    ]
    with open("README.md", encoding="utf-8") as readme:
        if f"Rust toolchain ({stated} or newer)" not in readme.read():
            failures.append(f"README.md does not state the minimum Rust version {stated}")
    for failure in sorted(failures):
        print(failure)
    if failures:
        return 1
    print(f"rust-version {stated}: every locked dependency declares it or older, as README.md says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
