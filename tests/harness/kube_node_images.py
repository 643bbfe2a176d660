"""Images for the one-node cluster: the pause image written here, the pdserve image from
tools/image/build.sh, both imported into containerd with `ctr` (no registry is reachable).

    archive = write_pause_image(bin_dir / "pause", work_dir / "pause.oci.tar")
    import_image(ctr, archive)                      # ctr: ["ctr", "--address", sock, "-n", "k8s.io"]
    pdserve_image()                                 # -> (name, archive path); ImageMissing if not built
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import time
from pathlib import Path

from harness.procs import REPO

PAUSE_IMAGE = "pdserve.local/pause:1"
IMAGE_BUILD_SCRIPT = REPO / "tools" / "image" / "build.sh"
# The longest the one-node cluster waits for an image build still running in the background (`make
# test` starts it first; a first build took 25 minutes on a loaded 2-core machine).
IMAGE_WAIT_S = 3600.0


class ImageMissing(RuntimeError):
    """The pdserve image is not built for the current sources; the message says to run `make image`."""


def _blob(tar: tarfile.TarFile, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':')[1]}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def write_pause_image(binary: Path, out: Path, name: str = PAUSE_IMAGE) -> Path:
    """An OCI image archive with one uncompressed layer holding `binary` as /pause (its entry point)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        data = binary.read_bytes()
        info = tarfile.TarInfo("pause")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        t.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    with tarfile.open(out, "w") as tar:
        config_desc = _blob(tar, config, "application/vnd.oci.image.config.v1+json")
        layer_desc = _blob(tar, layer_bytes, "application/vnd.oci.image.layer.v1.tar")
        manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "config": config_desc, "layers": [layer_desc]}).encode()
        manifest_desc = _blob(tar, manifest, "application/vnd.oci.image.manifest.v1+json")
        manifest_desc["annotations"] = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name}
        for path, doc in (("oci-layout", {"imageLayoutVersion": "1.0.0"}),
                          ("index.json", {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                                          "manifests": [manifest_desc]})):
            data = json.dumps(doc).encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def pdserve_image(wait_s: float = IMAGE_WAIT_S) -> tuple[str, Path]:
    """(image name, OCI archive) of the pdserve image for the current sources, built by `make image`
    or still being built in the background (`make test`): waits up to ``wait_s`` for that build."""
    def ask(flag: str) -> str:
        return subprocess.run(["bash", str(IMAGE_BUILD_SCRIPT), flag], capture_output=True, text=True,
                              check=True).stdout.strip()

    start = time.monotonic()
    waited = subprocess.run(["bash", str(IMAGE_BUILD_SCRIPT), "--wait"], capture_output=True, text=True,
                            timeout=wait_s)
    if time.monotonic() - start > 1:
        print(f"waited {time.monotonic() - start:.0f}s for the image build: {waited.stdout.strip()}")
    name, archive = ask("--name"), Path(ask("--archive"))
    if not archive.is_file():
        raise ImageMissing(f"the pdserve image {name} is not built for these sources ({archive} is missing): "
                           f"run make image (tools/image/build.sh)\n{waited.stderr[-3000:]}")
    return name, archive


def image_present(ctr: list[str], name: str) -> bool:
    out = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True).stdout
    return name in out.split()


def import_image(ctr: list[str], archive: Path, name: str) -> float:
    """Import (and unpack for the overlayfs snapshotter) an OCI archive unless `name` is already
    there; returns the seconds it took (0 when it was there)."""
    if image_present(ctr, name):
        return 0.0
    start = time.monotonic()
    proc = subprocess.run([*ctr, "images", "import", str(archive)], capture_output=True, text=True)
    if proc.returncode != 0 or not image_present(ctr, name):
        raise RuntimeError(f"ctr images import {archive} did not give {name}:\n{proc.stdout}\n{proc.stderr}")
    return time.monotonic() - start
