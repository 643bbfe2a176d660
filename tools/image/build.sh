#!/usr/bin/env bash
# Build (or reuse) the pdserve CPU image, or with --cuda the CUDA image, from the Dockerfile, without
# Docker: buildah (chroot isolation, its own storage) over a Debian base made with debootstrap,
# exported as an OCI archive that containerd imports (tests/harness/kube_node.py). No container
# registry is needed.
#
# Everything goes to a cache OUTSIDE the repository:
#   ${PDSERVE_CACHE:-$HOME/.cache/pdserve}/image/
#     pdserve-<inputs hash>.oci.tar   the image (localhost/pdserve:<inputs hash>), layers zstd-compressed
#     pdserve-<inputs hash>.json      its name, size and how long the build took
#     cuda/pdserve-cuda-<hash>.*      the same for the CUDA image (localhost/pdserve-cuda:<hash>)
#     base-<recipe hash>.tar          the Debian root file system the image starts FROM
#     buildah/                        buildah's storage (layer cache: the dependency layer is reused
#                                     while pyproject.toml and the Dockerfile stay the same; it is
#                                     the same layer for both images, and each build keeps the
#                                     other kind's image and layers)
# The inputs hash covers the Dockerfile, .dockerignore, pyproject.toml, README.md, every file the
# Dockerfile COPYs, the build arguments and the base image's recipe (the section of this script that
# makes it); the image is rebuilt only when one of them changes.
#
# Usage: tools/image/build.sh [--cuda] [ACTION]
#        tools/image/build.sh              build what is missing, print progress, fail loudly
#        tools/image/build.sh --archive    only print the archive path for the current inputs
#        tools/image/build.sh --name       only print the image name (localhost/pdserve:<hash>)
#        tools/image/build.sh --background start the build (if the image is missing) at idle CPU and I/O
#                                          priority and return at once (`make test`: the suite runs meanwhile)
#        tools/image/build.sh --wait       wait for a build in progress; exit 0 only if the image for the
#                                          current inputs is there (else the background log's end, exit 1)
#        tools/image/build.sh --cuda --check  run tools/image/check_cuda.py in the built CUDA image again
#                                          (the build runs it before exporting; `make image-cuda-check`)
# --cuda: the CUDA image (Dockerfile KIND=cuda; `make image-cuda`): the nvidia-* libraries torch loads,
# nixl-cu13 with UCX's CUDA transports, Triton with a C compiler and the Python headers; checked
# without a GPU by tools/image/check_cuda.py (tools/image/README.md: what is in it, its size).
# Environment: PDSERVE_CACHE (cache root), TORCH_INDEX, PRUNE, PRUNE_NVIDIA (the Dockerfile's build arguments;
# defaults here: PyPI and, for the CPU image, what a CPU image of PyPI's torch never loads, see below; for
# the CUDA image none: prune_cuda.py runs in the Dockerfile), STORAGE_DRIVER
# (overlay, else vfs is tried), DEBIAN_MIRROR.
#
# torch: the Dockerfile installs it from TORCH_INDEX (download.pytorch.org's CPU wheels, ~200 MB).
# Where only PyPI is reachable (this project's machines) that index cannot be used; PyPI's Linux
# wheel is the CUDA build, which pulls ~3 GB of nvidia-* libraries that libtorch links against
# (torch does not import without them: tested with --no-deps). PRUNE removes the packages of that
# set that a CPU image never loads (triton: torch.compile only; cuSOLVER: CUDA linear algebra, loaded
# lazily; CCCL: headers), and PRUNE_NVIDIA=1 deletes every nvidia-* file that serving the built-in
# model on a CPU does not load (measured in the build: tools/image/prune_nvidia.py, ~1.2 GB); the build
# then checks that torch imports and computes. The image is still large here (libtorch_cuda, cuBLAS,
# NCCL, ... must exist to import torch); built elsewhere with the default TORCH_INDEX it is not. The
# size is printed and recorded.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${PDSERVE_CACHE:-$HOME/.cache/pdserve}/image"
TORCH_INDEX="${TORCH_INDEX:-https://pypi.org/simple}"
KIND=cpu
if [[ "${1:-}" == --cuda ]]; then KIND=cuda; shift; fi
if [[ $KIND == cpu ]]; then
  PRUNE="${PRUNE-triton nvidia-cusolver nvidia-cuda-cccl}"
  PRUNE_NVIDIA="${PRUNE_NVIDIA-1}"
else
  PRUNE="${PRUNE-}"
  PRUNE_NVIDIA="${PRUNE_NVIDIA-0}"
fi
# The base: Debian 12 (python3 3.11, the Python pyproject.toml allows) with python3-venv.
BASE_SUITE=bookworm
BASE_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_PACKAGES=python3,python3-venv,ca-certificates

# The build context's inputs: what the Dockerfile COPYs from the context (not --from a stage).
copied_paths() {
  awk 'toupper($1) == "COPY" && $2 !~ /^--from/ { for (i = 2; i < NF; i++) print $i }' "$REPO/Dockerfile"
}
inputs_hash() {
  local files
  files="$(cd "$REPO" && { printf '%s\n' Dockerfile .dockerignore pyproject.toml;
    copied_paths | xargs -r find 2>/dev/null | grep -v -e __pycache__ -e '\.pyc$' -e '\.egg-info'; } | sort -u)"
  (cd "$REPO" && for f in $files; do [[ -f "$f" ]] && printf '%s %s\n' "$f" "$(sha256sum < "$f" | cut -c1-64)"; done
   echo "TORCH_INDEX=$TORCH_INDEX PRUNE=$PRUNE PRUNE_NVIDIA=$PRUNE_NVIDIA BASE=$BASE_HASH${KIND/#cpu/}") | sha256sum | cut -c1-16
}
BASE_HASH="$(printf '%s\n' "$BASE_SUITE" "$BASE_PACKAGES" "$(sed -n '/^# --- the base image/,/^# --- the image/p' "$0")" \
  | sha256sum | cut -c1-12)"
HASH="$(inputs_hash)"
# Each kind's files: the CPU image's at the top of the cache (as before), the CUDA image's in cuda/.
if [[ $KIND == cpu ]]; then DIR="$CACHE" PREFIX=pdserve OTHER_DIR="$CACHE/cuda" OTHER_PREFIX=pdserve-cuda
else DIR="$CACHE/cuda" PREFIX=pdserve-cuda OTHER_DIR="$CACHE" OTHER_PREFIX=pdserve; fi
NAME="localhost/$PREFIX:$HASH"
ARCHIVE="$DIR/$PREFIX-$HASH.oci.tar"
INFO="$DIR/$PREFIX-$HASH.json"
START=$SECONDS
say() { printf '[image %4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { echo "image: ERROR: $*" >&2; exit 1; }
built() { [[ -s "$ARCHIVE" && -s "$INFO" ]]; }
BACKGROUND_LOG="$DIR/background.log"

case "${1:-}" in
  --archive) echo "$ARCHIVE"; exit 0 ;;
  --name) echo "$NAME"; exit 0 ;;
  --background|--wait|"") ;;
  --check) [[ $KIND == cuda ]] || { echo "$0: --check is for the CUDA image (--cuda --check)" >&2; exit 2; } ;;
  *) echo "usage: $0 [--cuda] [--archive|--name|--background|--wait|--check]" >&2; exit 2 ;;
esac

install_tools() {
  local missing=() SUDO=""
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [[ ${#missing[@]} -gt 0 ]] || return 0
  say "installing ${missing[*]} (Debian packages)"
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || die "cannot install ${missing[*]}"
}

mkdir -p "$CACHE" "$DIR"
if [[ "${1:-}" == --wait ]]; then
  exec 9>"$CACHE/.build.lock"
  flock -n 9 || { say "waiting for the image build in progress (log: $BACKGROUND_LOG)"; flock 9; }
  built || { tail -30 "$BACKGROUND_LOG" >&2 2>/dev/null || true; die "no image $NAME for the current sources: run make image${KIND/#cpu/}"; }
  say "ready: $NAME ($(du -h "$ARCHIVE" | cut -f1) archive)"
  exit 0
fi
if [[ "${1:-}" == --background ]]; then
  built && { say "cached: $NAME"; exit 0; }
  exec 9>"$CACHE/.build.lock"
  flock -n 9 || { say "an image build is already running"; exit 0; }
  install_tools
  # The child inherits the lock (fd 9, the same open file), so --wait cannot slip in before it starts.
  idle=(nice -n 19); command -v ionice >/dev/null && idle+=(ionice -c 3)
  kind_flag=(); [[ $KIND == cuda ]] && kind_flag=(--cuda)
  PDSERVE_IMAGE_LOCKED=1 setsid "${idle[@]}" bash "$0" "${kind_flag[@]}" > "$BACKGROUND_LOG" 2>&1 < /dev/null &
  say "building $NAME in the background at idle priority (pid $!, log: $BACKGROUND_LOG)"
  exit 0
fi
if [[ -z "${PDSERVE_IMAGE_LOCKED:-}" ]]; then
  exec 9>"$CACHE/.build.lock"
  if ! flock -n 9; then
    say "another build holds $CACHE/.build.lock; waiting for it"
    flock 9
  fi
fi
if built && [[ "${1:-}" != --check ]]; then
  say "cached: $NAME ($(du -h "$ARCHIVE" | cut -f1) archive; $(cat "$INFO"))"
  exit 0
fi

# --- the tools: Debian packages (installed before a background build starts: apt has one lock) --
install_tools

# buildah with its own storage in the cache (never the machine's /var/lib/containers).
DRIVER="${STORAGE_DRIVER:-overlay}"
RUNROOT="/run/pdserve-buildah-$(id -u)"
bah() { buildah --root "$CACHE/buildah-$DRIVER" --runroot "$RUNROOT-$DRIVER" --storage-driver "$DRIVER" "$@"; }
nice_bah() { nice buildah --root "$CACHE/buildah-$DRIVER" --runroot "$RUNROOT-$DRIVER" --storage-driver "$DRIVER" "$@"; }
if ! probe="$(bah from scratch 2>&1)"; then
  [[ "$DRIVER" == overlay ]] || die "buildah cannot use storage driver $DRIVER: $probe"
  say "storage driver overlay does not work here ($probe); using vfs (slower, more disk)"
  DRIVER=vfs
  probe="$(bah from scratch)" || die "buildah cannot use storage driver vfs either"
fi
bah rm "$probe" >/dev/null

# --- the CUDA image's check: tools/image/check_cuda.py inside the image (not copied into it), no GPU ---
check_cuda() {
  local ctr rc=0
  ctr="$(bah from --quiet "$NAME")"
  bah run --isolation chroot --volume "$HERE/check_cuda.py:/check_cuda.py:ro" "$ctr" -- \
    /opt/pdserve/bin/python /check_cuda.py || rc=$?
  bah rm "$ctr" >/dev/null
  return $rc
}
if [[ "${1:-}" == --check ]]; then
  if ! bah inspect --type image "$NAME" >/dev/null 2>&1; then
    built || die "no CUDA image $NAME for the current sources: run make image-cuda"
    say "importing $ARCHIVE into buildah's storage (another build removed the stored image)"
    id="$(bah pull --quiet "oci-archive:$ARCHIVE")" || die "cannot import $ARCHIVE"
    bah tag "$id" "$NAME"
  fi
  say "checking $NAME (tools/image/check_cuda.py)"
  check_cuda || die "the CUDA image check failed"
  say "the CUDA image check passed"
  exit 0
fi

# --- disk: a build needs room for the dependency layer, the runtime copy and the archive -------
# Measured peak of one build over what is already stored: ~15 GB (the build stage's ~6 GB image,
# the runtime stage's 3.6 GB layer written once as a blob and once unpacked, the 1.9 GB archive);
# the CUDA image's runtime layer and archive are larger (tools/image/README.md).
# Short of that, what earlier builds left goes first (their images, archives and the layer cache;
# the base image stays); still short, the build stops here with the numbers instead of failing halfway
# through a layer commit with ENOSPC (and filling the disk that etcd and the tests share).
if [[ $KIND == cpu ]]; then NEED_GB="${PDSERVE_IMAGE_NEED_GB:-16}"; else NEED_GB="${PDSERVE_IMAGE_NEED_GB:-20}"; fi
free_gb() { df -P -BG "$CACHE" | awk 'NR == 2 { sub("G", "", $4); print $4 }'; }
bah rm --all >/dev/null 2>&1 || true  # working containers a killed or failed build left behind
if (( $(free_gb) < NEED_GB )); then
  say "only $(free_gb) GB free on $(df -P "$CACHE" | awk 'NR == 2 { print $6 }') (a build needs ~$NEED_GB GB): removing earlier images and the layer cache"
  rm -f "$CACHE"/pdserve-*.oci.tar "$CACHE"/pdserve-*.json "$CACHE"/*.tmp "$CACHE"/cuda/pdserve-cuda-*
  base_id="$(bah images --noheading --no-trunc --format '{{.ID}}' "localhost/pdserve-base:$BASE_HASH" 2>/dev/null | sed 's/^sha256://' || true)"
  bah images --all --noheading --no-trunc --format '{{.ID}}' | sed 's/^sha256://' | while read -r id; do
    [[ "$id" == "$base_id" ]] || bah rmi --force "$id" >/dev/null 2>&1 || true
  done
  (( $(free_gb) >= NEED_GB )) || die "not enough disk for the image: $(free_gb) GB free in $CACHE, a build needs ~$NEED_GB GB (df -h; PDSERVE_CACHE moves the cache, PDSERVE_IMAGE_NEED_GB changes the check)"
  say "$(free_gb) GB free now"
fi

# --- the base image: a Debian root file system from debootstrap -----------------------------
BASE_TAR="$CACHE/base-$BASE_HASH.tar"
BASE_NAME="localhost/pdserve-base:$BASE_HASH"
if [[ ! -s "$BASE_TAR" ]]; then
  say "debootstrap $BASE_SUITE (minbase + $BASE_PACKAGES) from $BASE_MIRROR"
  root="$(mktemp -d "$CACHE/.rootfs.XXXXXX")"
  trap 'rm -rf "$root"' EXIT
  nice debootstrap --variant=minbase --include="$BASE_PACKAGES" "$BASE_SUITE" "$root" "$BASE_MIRROR" \
    > "$CACHE/debootstrap.log" 2>&1 || die "debootstrap failed; see $CACHE/debootstrap.log"
  # What a container image does not need: package downloads and lists, documentation, locales.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
  tar -C "$root" --numeric-owner -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
  rm -rf "$root"; trap - EXIT
  say "base root file system: $(du -h "$BASE_TAR" | cut -f1)"
fi
if ! bah inspect --type image "$BASE_NAME" >/dev/null 2>&1; then
  ctr="$(bah from scratch)"
  bah add "$ctr" "$BASE_TAR" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  bah commit --rm --quiet "$ctr" "$BASE_NAME" >/dev/null
  say "base image $BASE_NAME"
fi

# --- the image: `buildah bud` of the Dockerfile ---------------------------------------------
# Build-time only (not in the image): the machine's pip configuration and CA bundle, so pip in
# the build reaches PyPI the way it does on this machine (e.g. through a TLS-inspecting proxy).
volumes=()
for f in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt; do
  [[ -f "$f" ]] && volumes+=(--volume "$f:$f:ro")
done
say "building $NAME from the Dockerfile (TORCH_INDEX=$TORCH_INDEX; the first build downloads torch)"
log="$DIR/build-$HASH.log"
( while sleep 60; do say "still building (log: $log)"; done ) &
ticker=$!
rc=0
(cd "$REPO" && nice_bah bud --isolation chroot --layers "${volumes[@]}" \
  --build-arg BASE="$BASE_NAME" --build-arg TORCH_INDEX="$TORCH_INDEX" --build-arg PRUNE="$PRUNE" --build-arg PRUNE_NVIDIA="$PRUNE_NVIDIA" \
  --build-arg KIND="$KIND" -t "$NAME" -f Dockerfile . > "$log" 2>&1) || rc=$?
pkill -PIPE -P "$ticker" sleep 2>/dev/null || true  # SIGPIPE: bash prints no "Terminated"
kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true
[[ $rc -eq 0 ]] || { bah rm --all >/dev/null 2>&1 || true; tail -30 "$log" >&2; df -h "$CACHE" >&2
                    die "buildah bud failed (log: $log)"; }
build_s=$((SECONDS - START))

# The image serves: the CLI and torch import and compute on CPU inside it (as the pods run it);
# the CUDA image is checked by check_cuda.py (its CUDA libraries, NIXL, Triton's compiler and launcher).
bah run --isolation chroot "$(bah from --quiet "$NAME")" -- /opt/pdserve/bin/python -c \
  'import torch, pdserve.cli; assert not torch.cuda.is_available(); print("torch", torch.__version__, (torch.ones(2, 2) @ torch.ones(2, 2)).sum().item())' \
  || die "the built image cannot import pdserve and run torch on CPU"
bah rm --all >/dev/null
if [[ $KIND == cuda ]]; then
  check_start=$SECONDS
  check_cuda || die "the CUDA image check failed (tools/image/check_cuda.py; the image stays stored: fix and rerun --cuda --check)"
  say "the CUDA image check passed ($((SECONDS - check_start)) s)"
fi

say "exporting $ARCHIVE"
bah push --quiet --compression-format zstd "$NAME" "oci-archive:$ARCHIVE.tmp:$NAME" >/dev/null \
  || die "buildah push to an OCI archive failed"
mv "$ARCHIVE.tmp" "$ARCHIVE"
unpacked="$(bah images --noheading --format '{{.Size}}' "$NAME" | head -1)"
archive_mb=$(( $(stat -c %s "$ARCHIVE") / 1000000 ))
total_s=$((SECONDS - START))
printf '{"name": "%s", "archive_mb": %d, "unpacked": "%s", "build_s": %d, "total_s": %d, "torch_index": "%s", "prune": "%s", "prune_nvidia": "%s", "kind": "%s"}\n' \
  "$NAME" "$archive_mb" "$unpacked" "$build_s" "$total_s" "$TORCH_INDEX" "$PRUNE" "$PRUNE_NVIDIA" "$KIND" > "$INFO"

# Keep only this image of its kind: older archives go, and every stored image but the base, this one,
# the other kind's latest and the layers of both kinds' latest builds (the cache of the next ones:
# the step images buildah printed as "--> <id>").
for old in "$DIR/$PREFIX"-*.oci.tar "$DIR/$PREFIX"-*.json "$DIR"/build-*.log "$CACHE"/base-*.tar; do
  [[ "$old" == *"$HASH"* || "$old" == "$BASE_TAR" ]] || rm -f "$old"
done
# (a cache that never built the other kind has no such file: no names, not a failed build)
other_names="$(cat "$OTHER_DIR/$OTHER_PREFIX"-*.json 2>/dev/null | sed -n 's/.*"name": "\([^"]*\)".*/\1/p' || true)"
bah images --noheading --format '{{.Name}}:{{.Tag}}' | grep -v -x -e "$NAME" -e "$BASE_NAME" ${other_names:+$(printf -- '-e %s ' $other_names)} \
  | grep -v '<none>' | xargs -r -n1 bah untag >/dev/null 2>&1 || true
keep="$(cat "$log" "$OTHER_DIR"/build-*.log 2>/dev/null | awk '$1 == "-->" { id = ($2 == "Using") ? $4 : $2; print substr(id, 1, 11) }' || true
  for image in "$NAME" "$BASE_NAME" $other_names; do bah images --noheading --format '{{.ID}}' "$image" 2>/dev/null | cut -c1-11; done)"
bah images --all --noheading --no-trunc --format '{{.ID}}' | sed 's/^sha256://' | while read -r id; do
  grep -qx "${id:0:11}" <<< "$keep" || bah rmi --force "$id" >/dev/null 2>&1 || true
done
say "built $NAME: archive ${archive_mb} MB, unpacked ${unpacked}, build ${build_s} s, total ${total_s} s"
