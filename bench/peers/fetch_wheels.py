"""Fetch a peer's wheel set where the package registry is reachable, and cut it into chunks of a set size.

``python -m bench.peers.fetch_wheels [--manifest bench/peers/vllm-0.26.0-wheels.txt] [--out out/peer-wheels]
[--chunk-mib 40]``

The manifest lists ``sha256  file  bytes`` per wheel (the set that ran the peer on the H200 image: Python 3.12,
torch 2.11.0+cu130, so the image's own packages are not in it). Each wheel is downloaded as exactly that file (pip
download, no dependencies, its own platform and ABI tags) and checked against its hash and size; then all of them and
the manifest go into one uncompressed tar, split into ``DIR/chunks/wheels.tar.NNN`` of at most ``--chunk-mib`` MiB,
with ``DIR/chunks/SHA256SUMS`` (each chunk, and the whole tar). ``bench/peers/vllm_gpu.sh`` stages, verifies and
installs them on the GPU machine. The recipe is committed; the wheels are not.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_MANIFEST = Path(__file__).with_name("vllm-0.26.0-wheels.txt")
PYTHON_VERSION = "3.12"


def read_manifest(path: Path) -> list[tuple[str, str, int]]:
    """``(sha256, file, bytes)`` per wheel; lines starting with # are comments."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 3 or len(fields[0]) != 64 or not fields[1].endswith(".whl") or not fields[2].isdigit():
            raise ValueError(f"{path}:{number}: expected 'sha256  file.whl  bytes', got {line!r}")
        entries.append((fields[0], fields[1], int(fields[2])))
    return entries


def pip_arguments(wheel: str) -> list[str]:
    """``pip download`` arguments that fetch exactly ``wheel`` (name-version-[build-]python-abi-platform.whl)."""
    parts = wheel[:-len(".whl")].split("-")
    name, version, abi, platform = parts[0], parts[1], parts[-2], parts[-1]
    args = [f"{name}=={version}", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION]
    if platform != "any":
        args += [option for tag in platform.split(".") for option in ("--platform", tag)]
        args += ["--implementation", "cp"] + [option for tag in abi.split(".") for option in ("--abi", tag)]
    return args


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(entries, wheels: Path) -> None:
    """Every wheel of ``entries`` in ``wheels``, each checked; a file already there with the right hash is kept."""
    wheels.mkdir(parents=True, exist_ok=True)
    for sha, name, size in entries:
        path = wheels / name
        if not (path.is_file() and sha256_of(path) == sha):
            subprocess.run([sys.executable, "-m", "pip", "download", *pip_arguments(name), "-d", str(wheels)],
                           check=True, stdout=subprocess.DEVNULL)
        if not path.is_file():
            raise SystemExit(f"pip did not fetch {name} (another build of the same version?): see {wheels}")
        got_sha, got_size = sha256_of(path), path.stat().st_size
        if (got_sha, got_size) != (sha, size):
            raise SystemExit(f"{name}: sha256 {got_sha} and {got_size} bytes, the manifest says {sha} and {size}")
        print(f"  {size:>11,}  {name}")


def chunk(entries, manifest: Path, wheels: Path, chunks: Path, chunk_bytes: int) -> list[Path]:
    """One tar of the manifest and the wheels, cut into ``chunks/wheels.tar.NNN``; ``SHA256SUMS`` beside them."""
    if chunks.exists():
        shutil.rmtree(chunks)
    chunks.mkdir(parents=True)
    whole = chunks.parent / "wheels.tar"
    with tarfile.open(whole, "w") as tar:
        tar.add(manifest, arcname=manifest.name)
        for _, name, _ in entries:
            tar.add(wheels / name, arcname=name)
    parts = []
    with whole.open("rb") as f:
        for index in range(10**3):
            data = f.read(chunk_bytes)
            if not data:
                break
            part = chunks / f"wheels.tar.{index:03d}"
            part.write_bytes(data)
            parts.append(part)
    sums = [f"{sha256_of(part)}  {part.name}" for part in parts] + [f"{sha256_of(whole)}  {whole.name}"]
    (chunks / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    whole.unlink()
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--out", type=Path, default=Path("out/peer-wheels"), help="wheels/ and chunks/ go here")
    parser.add_argument("--chunk-mib", type=int, default=40, help="largest chunk, MiB")
    args = parser.parse_args()
    entries = read_manifest(args.manifest)
    print(f"{len(entries)} wheels, {sum(size for _, _, size in entries) / 2**20:.1f} MiB ({args.manifest.name}):")
    fetch(entries, args.out / "wheels")
    parts = chunk(entries, args.manifest, args.out / "wheels", args.out / "chunks", args.chunk_mib << 20)
    print(f"{len(parts)} chunks of at most {args.chunk_mib} MiB in {args.out / 'chunks'} (SHA256SUMS beside them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
