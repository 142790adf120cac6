"""The console output of a fake 25-step run, parsed with the underfit dashboard's own regexes
(reference underfit.md §10), and loss_by_timestep.bin."""

import io
import re
import struct

import pytest

from sa3mlx.lora.config import LoRAConfig
from sa3mlx.train import progress as P

# the dashboard's patterns (dashboard/server.py), verbatim
NUM = r"([\d.eE+-]+|nan[\d.]*|inf[\d.]*)"
HISTORY_RE = re.compile(r"Epoch (\d+):\s+\d+%.*?(\d+)/(\d+).*?train/loss=" + NUM)
LR_RE = re.compile(r"train/lr=" + NUM)
GN_RE = re.compile(r"train/grad_norm=" + NUM)
LM_RE = re.compile(r"train/lora_magnitude=" + NUM)
STEP_PREFIX_RE = re.compile(r"Step (\d+),")
STATUS_RE = re.compile(r"Epoch (\d+):\s+(\d+)%.*?(\d+)/(\d+)")
STATUS_LOSS_RE = re.compile(r"train/loss=([\d.]+)")
STATUS_LR_RE = re.compile(r"train/lr=([\d.e+-]+)")
PBAR_SIG_RE = re.compile(r"^(.*?)\d+%\|[^|]*\|\s*\d+/(\d+)")

MAX_STEPS, PER_EPOCH, SAVE_EVERY = 25, 10, 10


def _metrics(step):
    return 1.0 / (step + 3), 1e-4 * (1 - 0.995 ** (step + 2)), min(1.0, 0.1 * step), 12.3456789 + step


def _fake_run(out, lbt):
    """underfit's loop shape: a bar per epoch, report after each step, save every 10, final save."""
    cfg = LoRAConfig()
    P.emit(P.lora_config_lines(cfg) + [P.lora_layers_line(141), P.trainable_params_line(9212672)], out)
    P.emit(P.training_to_lines(MAX_STEPS, 0, SAVE_EVERY), out)
    step, epoch = 0, 0
    while step < MAX_STEPS:
        bar = P.epoch_bar(iter(range(PER_EPOCH)), step, epoch, total=PER_EPOCH, file=out)
        for _ in bar:
            loss, lr, gn, lm = _metrics(step)
            lbt.write(step, 0.5 + step / 100, loss)
            step += 1
            P.report_step(bar, step, epoch, loss, lr, gn, lm)
            if step % SAVE_EVERY == 0:
                with P.bar_paused(bar):
                    P.emit(P.saved_line(f"runs/x/step={step}-epoch={epoch}.safetensors"), out)
            if step >= MAX_STEPS:
                break
        bar.close()
        epoch += 1
    P.emit(P.saved_line(f"runs/x/step={step}-epoch={epoch}.safetensors", final=True), out)
    P.emit(P.TRAINING_DONE, out)


def test_fake_run_matches_the_dashboard_regexes(tmp_path):
    out = io.StringIO()
    with P.LossByTimestepLog(tmp_path / "demos" / P.LOSS_BY_TIMESTEP_FILE) as lbt:
        _fake_run(out, lbt)
    text = out.getvalue()

    expected_plain = [
        "LoRA config: rank=16, alpha=16, adapter_type=dora-rows",
        "  exclude: ['to_timestep_embed', 'to_cond_embed', 'to_global_embed', 'to_local_embed', "
        "'global_cond_embedder', 'project_in', 'project_out', 'preprocess_conv', 'postprocess_conv']",
        "lora layers: 141",
        "Trainable LoRA params: 9,212,672",
        "Training to global step 25 (25 new steps from step_offset=0); save every 10",
        "✓ Saved checkpoint -- step=10-epoch=0.safetensors",
        "✓ Saved checkpoint -- step=20-epoch=1.safetensors",
        "✓ Saved checkpoint -- step=25-epoch=3.safetensors (final)",
        "Training done",
    ]
    plain, history = [], {}
    for line in text.splitlines():  # str.splitlines also splits at tqdm's \r, as the history parser does
        if not line.strip():
            continue
        if not PBAR_SIG_RE.match(line):
            plain.append(line)
            continue
        status = STATUS_RE.search(line)
        assert status, line
        m = HISTORY_RE.search(line)
        if m is None:  # a draw before the epoch's first step: no metrics yet, skipped by the parser
            assert "train/" not in line and status.group(3) == "0", line
            continue
        n, total = int(m.group(2)), int(m.group(3))
        assert total == PER_EPOCH and status.group(4) == str(PER_EPOCH)
        if n == 0:
            continue  # the dashboard ignores the n = 0 draws
        step = int(STEP_PREFIX_RE.search(line).group(1))
        assert STATUS_LOSS_RE.search(line) and STATUS_LR_RE.search(line)
        values = (
            m.group(4),
            LR_RE.search(line).group(1),
            GN_RE.search(line).group(1),
            LM_RE.search(line).group(1),
            int(m.group(1)),
        )
        # underfit redraws on set_postfix before set_description, so a "Step g" line can already
        # carry step g+1's metrics; the first "Step g" line with n > 0 carries step g's
        history.setdefault(step, values)
        assert values[0] in (f"{_metrics(step - 1)[0]:.6f}", f"{_metrics(step)[0]:.6f}")
    assert [p.lstrip("\r") for p in plain] == expected_plain

    assert sorted(history) == list(range(1, MAX_STEPS + 1))
    for step, (loss, lr, gn, lm, epoch) in history.items():
        want = _metrics(step - 1)
        assert loss == f"{want[0]:.6f}" and lr == f"{want[1]:.3e}"
        assert gn == f"{want[2]:.6f}" and lm == f"{want[3]:.6f}"
        assert epoch == (step - 1) // PER_EPOCH
        assert re.fullmatch(r"\d\.\d{6}", loss) and re.fullmatch(r"\d\.\d{3}e[+-]\d\d", lr)
    last_bar = [ln for ln in text.splitlines() if PBAR_SIG_RE.match(ln)][-1]
    # on the break at max_steps tqdm's count lags one batch behind, as in underfit
    assert last_bar.startswith("Step 25, Epoch 2:  40%|") and "| 4/10 [" in last_bar
    # what the dashboard parses off the last draw (tqdm pads a redraw to the previous line's length,
    # which depends on the measured rate, so the line's tail is not compared)
    want = _metrics(24)
    assert HISTORY_RE.search(last_bar).group(4) == f"{want[0]:.6f}"
    assert LR_RE.search(last_bar).group(1) == f"{want[1]:.3e}"
    assert GN_RE.search(last_bar).group(1) == f"{want[2]:.6f}" and LM_RE.search(last_bar).group(1) == f"{want[3]:.6f}"

    records = P.read_loss_by_timestep(tmp_path / "demos" / P.LOSS_BY_TIMESTEP_FILE)
    raw = (tmp_path / "demos" / P.LOSS_BY_TIMESTEP_FILE).read_bytes()
    assert len(raw) == 12 * MAX_STEPS and struct.unpack_from("<Iff", raw, 12) == records[1]
    assert [r[0] for r in records] == list(range(MAX_STEPS))
    assert records[3][1] == pytest.approx(0.53) and records[3][2] == pytest.approx(1 / 6)


def test_loss_by_timestep_appends_and_flushes(tmp_path):
    path = tmp_path / "loss_by_timestep.bin"
    log = P.LossByTimestepLog(path)
    log.write(10, 0.25, 1.5)  # step % 10 == 0: on disk at once
    assert path.stat().st_size == 12
    log.write(11, 0.5, 2.0)
    log.close()
    with P.LossByTimestepLog(path) as again:  # a resume appends
        again.write(12, 0.75, 3.0)
    assert P.read_loss_by_timestep(path) == [(10, 0.25, 1.5), (11, 0.5, 2.0), (12, 0.75, 3.0)]


def test_console_lines():
    assert P.lora_config_lines(LoRAConfig(adapter_type="lora", rank=8, alpha=4.0, include=("attn",), exclude=None)) == [
        "LoRA config: rank=8, alpha=4.0, adapter_type=lora",
        "  include: ['attn']",
    ]
    assert (
        P.training_to_lines(100, 100, 50)[1]
        == "step_offset (100) is already at or past max_steps (100); nothing to train."
    )
    assert (
        P.oversampling_line(1, 8, 800, True)
        == "Dataset has 1 file < batch_size 8; oversampling with replacement → 800 samples/epoch (100 iters/epoch)"
    )
    assert P.resume_line(2000, 4) == "Resuming from step offset 2000, epoch offset 4"
    assert P.step_postfix(0.5, 1e-4) == {"train/loss": "0.500000", "train/lr": "1.000e-04"}
    assert P.prompt_preview_lines(["a"]) == ["Prompt preview (1 samples):", "  [0] 'a'"]
