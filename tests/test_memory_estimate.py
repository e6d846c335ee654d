"""Will a model fit one shared GPU (serving.memory_estimate), and what the run does about it
(run.config.resolve_release): release where the model needs it, a clear error before anything starts
where it cannot fit. Model directories hold only config.json (and an index), GPUs are described or
read through the fake NVML of test_gpus; no GPU, no weights."""
import json

import pytest

from artsg_nb.run.config import RunConfig, resolve_release
from artsg_nb.serving import gpus
from artsg_nb.serving.gpus import GpuInfo
from artsg_nb.serving.memory_estimate import (GIB, ModelMemory, ModelTooLargeError, colocated_fit)
from test_gpus import fake_pynvml

H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-0", 81559.0, 0.0)
H200 = GpuInfo(0, "NVIDIA H200", "GPU-0", 143771.0, 0.0)
# Llama-2-7B, Qwen2.5-14B's dimensions, a 70B's (bf16, 49152-token vocab)
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}


def model_dir(tmp_path, shape: str, **extra):
    path = tmp_path / shape
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": 49152, "tie_word_embeddings": False,
                                                  **SHAPES[shape], **extra}))
    return path


def test_model_memory_from_a_config_by_hand(tmp_path):
    path = tmp_path / "small"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)))
    m = ModelMemory.from_dir(path, lora_rank=8)
    assert m.kv_per_token == 2 * 2 * 2 * 16 * 2  # k and v, layers, KV heads, head dim, bf16
    assert m.activations_per_token == 2 * (64 * 10 + 128 * 6) * 2
    # q, o: 64 + 64 in and out; k, v: 64 + 32; gate, up, down: 64 + 128; rank 8, 2 layers, 16 bytes
    assert m.lora == 8 * (128 * 2 + 96 * 2 + 192 * 3) * 2 * 16
    # bf16 from the shape: q,k,v,o and the MLP a layer, embeddings and an untied head
    assert m.weights == 2 * (2 * (64 * (4 + 4) * 16 + 64 * 64 + 3 * 64 * 128) + 2 * 100 * 64)
    (path / "model.safetensors").write_bytes(b"x" * 1234)  # the files' size where there is no index
    assert ModelMemory.from_dir(path).weights == 1234
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 5678}}))
    assert ModelMemory.from_dir(path).weights == 5678
    assert ModelMemory.from_dir(tmp_path / "nowhere") is None  # a hub id or a name: no estimate


def test_14b_needs_release_on_an_80gb_gpu_not_on_an_h200(tmp_path):
    m = ModelMemory.from_dir(model_dir(tmp_path, "14b"))
    assert m.weights / GIB == pytest.approx(25.5, abs=0.1)
    h100, h200 = colocated_fit(m, H100), colocated_fit(m, H200)
    # measured (299b538): with only the KV cache and CUDA graphs released it ran out of memory
    assert not h100.fits(False) and not h100.fits(True) and h100.fits(True, True)
    assert h200.fits(False)
    assert colocated_fit(ModelMemory.from_dir(model_dir(tmp_path, "7b")), H100).fits(False)
    # a smaller micro-batch budget makes the trainer smaller
    assert colocated_fit(m, H100, micro_batch_tokens=512).trainer_gib < h100.trainer_gib
    big = colocated_fit(ModelMemory.from_dir(model_dir(tmp_path, "70b")), H100)
    assert not big.server_fits and not big.fits(True, True)


def test_default_releases_memory_only_where_the_model_needs_it(tmp_path):
    cfg = RunConfig(model_path=str(model_dir(tmp_path, "14b")))
    assert cfg.release_memory == "if_needed"
    assert resolve_release(cfg, "colocated", gpus=[H100]).on is True
    assert resolve_release(cfg, "colocated", gpus=[H200]).on is False
    assert resolve_release(cfg, "split", gpus=[H100, H100]).on is False
    seven = RunConfig(model_path=str(model_dir(tmp_path, "7b")))
    assert resolve_release(seven, "colocated", gpus=[H100]).on is False
    assert resolve_release(RunConfig(), "colocated", gpus=[H100]).on is False  # the tiny model: nothing to estimate
    assert resolve_release(RunConfig(release_memory="auto", model_path=seven.model_path), "colocated", gpus=[H100]).on


def test_the_default_releases_the_weights_too_where_only_that_fits(tmp_path):
    """14B on an 80 GB GPU ran out of memory with the KV cache and CUDA graphs released (299b538): the
    default adds "weights" (and the server keeps a host copy); a user's own release settings are
    kept, and refused with what to change where they cannot fit."""
    fourteen = str(model_dir(tmp_path, "14b"))
    release = resolve_release(RunConfig(model_path=fourteen), "colocated", gpus=[H100])
    assert release.on and release.tags == ("kv_cache", "cuda_graph", "weights")
    assert "releasing weights too" in release.why
    seven = resolve_release(RunConfig(model_path=str(model_dir(tmp_path, "7b"))), "colocated", gpus=[H100])
    assert seven.tags == ("kv_cache", "cuda_graph")
    with pytest.raises(ModelTooLargeError, match=r"release_tags=\('kv_cache', 'cuda_graph', 'weights'\)"):
        resolve_release(RunConfig(model_path=fourteen, release_memory=True), "colocated", gpus=[H100])


def test_a_model_that_does_not_fit_as_configured_says_what_to_change(tmp_path):
    fourteen = str(model_dir(tmp_path, "14b"))
    with pytest.raises(ModelTooLargeError, match=r"needed 9\d\.\d GiB with both resident.*Try: release_memory='if_needed' \(the default: it releases "
                                                   r"the server's weights too here\)"):
        resolve_release(RunConfig(model_path=fourteen, release_memory=False), "colocated", gpus=[H100])
    with pytest.raises(ModelTooLargeError, match=r"server 1\d\d\.\d GiB .* share.*Try: a GPU with more memory, 2\+ GPUs"):
        resolve_release(RunConfig(model_path=str(model_dir(tmp_path, "70b"))), "colocated", gpus=[H100])
    with pytest.raises(ValueError, match="does not fit the shared GPU without it.*pipeline=False to release"):
        resolve_release(RunConfig(model_path=fourteen, pipeline=True), "colocated", gpus=[H100])
    assert resolve_release(RunConfig(model_path=fourteen, pipeline=True), "colocated", gpus=[H200]).on is False


def test_the_run_stops_before_any_server_starts(tmp_path, monkeypatch):
    """GRPORun.start on a (fake) 80 GB GPU with a 70B: the error comes from the plan, no server is launched."""
    from artsg_nb.run import session

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("NVIDIA H100 80GB HBM3", "GPU-aa", 81559, 0)]))
    launched = []
    monkeypatch.setattr(session, "start_inference", lambda *a, **k: launched.append(a))
    run = session.GRPORun(RunConfig(model_path=str(model_dir(tmp_path, "70b")), run_dir=str(tmp_path / "run"),
                                    engine="sglang"))
    with pytest.raises(ModelTooLargeError, match="does not fit one GPU shared by the server and the trainer"):
        run.start()
    assert launched == []


def test_a_14b_run_on_an_80gb_gpu_starts_its_server_with_a_host_copy_of_the_weights(tmp_path, monkeypatch):
    """GRPORun.start on a (fake) H100 with a 14B and every default: the server is started able to
    release its weights (--enable-weights-cpu-backup) and the run's recorded config says so."""
    from artsg_nb.run import session

    class Stop(Exception):
        pass

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("NVIDIA H100 80GB HBM3", "GPU-aa", 81559, 0)]))
    started = []

    def start_inference(scfg, plan, run_dir):
        started.append(scfg)
        raise Stop

    monkeypatch.setattr(session, "start_inference", start_inference)
    monkeypatch.setattr(session, "make_trainer", lambda *a, **k: None)
    run = session.GRPORun(RunConfig(model_path=str(model_dir(tmp_path, "14b")), run_dir=str(tmp_path / "run"),
                                    engine="sglang", verbose=False))
    with pytest.raises(Stop):
        run.start()
    [scfg] = started
    assert scfg.enable_memory_saver and scfg.enable_weights_cpu_backup
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["release_tags"] == ["kv_cache", "cuda_graph", "weights"]


def test_release_tags_given_as_a_list_start_without_a_weights_warning(tmp_path, monkeypatch, caplog):
    """RunConfig accepts release_tags as a list; a list is never equal to the resolved tuple, which
    once logged "the server's weights are released ... too" for every such run."""
    from artsg_nb.run import session

    class Stop(Exception):
        pass

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "pynvml", fake_pynvml([("NVIDIA H100 80GB HBM3", "GPU-aa", 81559, 0)]))
    monkeypatch.setattr(session, "start_inference", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    monkeypatch.setattr(session, "make_trainer", lambda *a, **k: None)
    run = session.GRPORun(RunConfig(model_path=str(model_dir(tmp_path, "7b")), run_dir=str(tmp_path / "run"),
                                    engine="sglang", verbose=False, release_tags=["kv_cache", "cuda_graph"]))
    with caplog.at_level("WARNING"), pytest.raises(Stop):
        run.start()
    assert "weights are released" not in caplog.text
