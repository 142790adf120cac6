"""The peak-memory estimate before the first step: the model, the grad_checkpoint rule, the
settings it proposes, the budget, and the trainer stopping cleanly (run directory resumable)."""

import io
from dataclasses import replace

import numpy as np
import pytest
import test_train_checkpoint
from test_train_checkpoint import tiny_job

from sa3mlx.models.config import DiTConfig, ModelConfig
from sa3mlx.runtime.precision import COMPUTE, STORED
from sa3mlx.train import memory as M
from sa3mlx.train.job import MEMORY_EXIT
from sa3mlx.train.presets import resolve
from sa3mlx.train.runs import list_checkpoints

CFG = DiTConfig(
    io_channels=64,
    embed_dim=512,
    depth=8,
    num_heads=8,
    cond_token_dim=768,
    global_cond_dim=768,
    local_add_cond_dim=65,
    num_memory_tokens=64,
    timestep_features_dim=256,
    ff_inner=2048,
    differential=False,
)
WEIGHTS = 1e9
tiny_project = test_train_checkpoint.tiny_project  # the fixture, shared


def est(crop=1000, micro=1, ckpt=False, cfg=CFG):
    return M.estimate_peak_bytes(cfg, M.StepShape(crop, micro, ckpt), WEIGHTS)


def test_the_model_in_numbers():
    L = 1000 + 64
    block = 4 * (M.ALPHA * L * 512 + M.BETA * 8 * L * L)
    assert M.block_activation_bytes(CFG, 1000) == pytest.approx(block)
    peak = 4 * M.BLOCK_PEAK_MAPS * 8 * L * L
    assert M.backward_peak_bytes(CFG, 1000) == pytest.approx(peak)
    assert est() == pytest.approx(WEIGHTS + 8 * block + peak + M.OVERHEAD_BYTES)
    kept = 8 * 4 * M.CKPT_KEPT * L * 512
    assert est(ckpt=True) == pytest.approx(WEIGHTS + kept + block + peak + M.OVERHEAD_BYTES)
    assert est(micro=3) - est(micro=1) == pytest.approx(2 * (est() - WEIGHTS - M.OVERHEAD_BYTES))
    differential = replace(CFG, differential=True)
    assert M.block_activation_bytes(differential, 1000) - block == pytest.approx(4 * M.BETA * 8 * L * L)
    assert est(ckpt=True) < est() and est(crop=2000) > est()


def test_chunked_attention_keeps_no_maps():
    """Above CHUNK_BYTES of scores (crop 4096 here: 4·8·4160² B) the attention backward is its own:
    the maps are neither kept nor whole at the peak, a few chunks of them are."""
    long = 4096
    assert M.chunked(CFG, long) and not M.chunked(CFG, 1000)
    assert M.block_activation_bytes(CFG, long) == pytest.approx(4 * M.ALPHA * (long + 64) * 512)
    assert M.backward_peak_bytes(CFG, long) == pytest.approx(M.CHUNKS_IN_FLIGHT * M.CHUNK_ROWS_BYTES)
    differential = replace(CFG, differential=True)
    assert M.backward_peak_bytes(differential, long) == pytest.approx(2 * M.backward_peak_bytes(CFG, long))


def test_parameter_count_of_a_lazy_dit():
    tiny = replace(CFG, depth=1)
    two = replace(CFG, depth=2)
    per_block = M.dit_parameter_count(two) - M.dit_parameter_count(tiny)
    E, F, head = 512, 2048, 64
    attention = (3 * E * E + E * E + 2 * head) + (E * E + 2 * E * E + E * E + 2 * head)  # + the q/k norm gains
    assert per_block == attention + (E * 2 * F + 2 * F + F * E + E) + (65 * E + E + E * E + E) + 3 * E + 6 * E


def test_checkpoint_rule_follows_the_budget():
    shape = M.StepShape(1000, 2, False)
    plain, ckpt = est(micro=2), est(micro=2, ckpt=True)
    assert M.choose_checkpoint(CFG, shape, WEIGHTS, 10 * plain) is False
    assert M.choose_checkpoint(CFG, shape, WEIGHTS, (plain + ckpt) / 2 / M.USABLE) is True


def test_alternatives_name_settings_that_fit():
    shape = M.StepShape(1000, 8, False)
    between = (est(micro=8) + est(micro=8, ckpt=True)) / 2 / M.USABLE
    assert M.alternatives(CFG, shape, WEIGHTS, between, batch=8)[0].startswith("train.grad_checkpoint: true")
    tight = 1.001 * est(micro=2, ckpt=True) / M.USABLE  # checkpointing alone is not enough: micro-batches of 2 are
    lines = M.alternatives(CFG, shape, WEIGHTS, tight, batch=8)
    assert not any(line.startswith("train.grad_checkpoint") for line in lines)
    assert "train.grad_accum: 4 (micro-batches of 2, same batch 8, grad_checkpoint: true)" in lines
    crops = [line for line in lines if line.startswith("train.latent_crop_length")]
    crop = int(crops[-1].split()[1])
    fits = lambda c: M.estimate_peak_bytes(CFG, M.StepShape(c, 8, True), WEIGHTS) <= M.USABLE * tight
    assert crop % 16 == 0 and fits(crop) and not fits(crop + 16)
    assert M.alternatives(CFG, shape, WEIGHTS, WEIGHTS / 2, batch=8) == []


def test_loaded_npz_bytes_reads_headers_only(tmp_path):
    path = tmp_path / "w.npz"
    np.savez(path, a=np.zeros((3, 4), np.float16), b=np.arange(5, dtype=np.int32))
    assert M.loaded_npz_bytes(path, 4) == 3 * 4 * 4 + 5 * 4
    assert M.loaded_npz_bytes(path, None) == 3 * 4 * 2 + 5 * 4


def test_memory_budget_override_and_system(monkeypatch):
    monkeypatch.setenv(M.MEMORY_ENV, "2.5")
    assert M.memory_budget() == (2_500_000_000, f"${M.MEMORY_ENV}")
    monkeypatch.setenv(M.MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=M.MEMORY_ENV):
        M.memory_budget()
    monkeypatch.delenv(M.MEMORY_ENV)
    budget, source = M.memory_budget()
    assert budget > 0 and source


def test_plan_decides_checkpointing_when_null(tiny_project, monkeypatch):
    model_dir = tiny_project / "models" / "converted" / "tiny-base"
    dit = ModelConfig.load(model_dir / "model_config.json").dit
    weights = M.model_weight_bytes(model_dir)
    assert weights > (model_dir / "dit.npz").stat().st_size  # fp16 storage, fp32 on the CPU
    cfg = resolve(None, {"batch_size": 4, "grad_accum": 2, "latent_crop_length": 2048})
    plain = M.estimate_peak_bytes(dit, M.StepShape(2048, 2, False), weights)
    ckpt = M.estimate_peak_bytes(dit, M.StepShape(2048, 2, True), weights)
    monkeypatch.setenv(M.MEMORY_ENV, str((plain + ckpt) / 2 / M.USABLE / M.GB))
    decided, check = M.plan_memory(model_dir, cfg, 2048)
    assert decided.grad_checkpoint is True and check.fits and check.shape == M.StepShape(2048, 2, True)
    monkeypatch.setenv(M.MEMORY_ENV, "1000")
    assert M.plan_memory(model_dir, cfg, 2048)[0].grad_checkpoint is False
    explicit = replace(cfg, grad_checkpoint=False)
    monkeypatch.setenv(M.MEMORY_ENV, str((plain + ckpt) / 2 / M.USABLE / M.GB))
    decided, check = M.plan_memory(model_dir, explicit, 2048)
    assert decided.grad_checkpoint is False and not check.fits
    assert check.options[0].startswith("train.grad_checkpoint: true")


def test_plan_keeps_the_base_stored_only_when_that_is_what_fits(tiny_project, monkeypatch):
    model_dir = tiny_project / "models" / "converted" / "tiny-base"
    dit = ModelConfig.load(model_dir / "model_config.json").dit
    compute, stored = M.model_weight_bytes(model_dir), M.model_weight_bytes(model_dir, STORED)
    assert stored < compute  # the DiT's fp16 as stored; the prompt encoder in fp32 either way
    shape = M.StepShape(2048, 2, True)
    need = lambda weights: M.estimate_peak_bytes(dit, shape, weights) / M.USABLE / M.GB
    cfg = resolve(None, {"batch_size": 2, "latent_crop_length": 2048, "grad_checkpoint": True})
    monkeypatch.setenv(M.MEMORY_ENV, str((need(compute) + need(stored)) / 2))
    decided, check = M.plan_memory(model_dir, cfg, 2048)
    assert decided.base_dtype == STORED and check.fits and check.need == pytest.approx(need(stored) * M.USABLE * M.GB)
    monkeypatch.setenv(M.MEMORY_ENV, "1000")
    assert M.plan_memory(model_dir, cfg, 2048)[0].base_dtype == COMPUTE
    plain = replace(cfg, grad_checkpoint=False, base_dtype=STORED)  # stored without checkpointing: worse
    assert (
        M.plan_memory(model_dir, plain, 2048)[1].need
        > M.plan_memory(model_dir, replace(plain, base_dtype=COMPUTE), 2048)[1].need
    )
    explicit = replace(cfg, base_dtype=COMPUTE)
    monkeypatch.setenv(M.MEMORY_ENV, str((need(compute) + need(stored)) / 2))
    decided, check = M.plan_memory(model_dir, explicit, 2048)
    assert decided.base_dtype == COMPUTE and not check.fits
    assert check.options[0].startswith("train.base_dtype: stored")


def test_a_step_that_cannot_fit_stops_cleanly_and_the_run_resumes(tiny_project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(M.MEMORY_ENV, "0.05")
    job = tiny_job(tiny_project, tmp_path)
    assert job.run(io.StringIO()) == MEMORY_EXIT
    text = capsys.readouterr().err
    assert "memory: this step would not fit; stopping before the first step" in text
    assert "nothing smaller fits" in text  # the weights alone exceed 50 MB
    assert not job.run_paths("x").root.exists()  # stopped before anything was built or touched
    monkeypatch.delenv(M.MEMORY_ENV)
    assert job.run(io.StringIO()) == 0
    assert "memory: estimated peak" in capsys.readouterr().err
    assert list_checkpoints(job.run_paths("x").root)[-1].name == "tiny-lora-step=8-epoch=2.safetensors"
