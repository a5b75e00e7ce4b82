"""Measure, once per model, the deviation real reordered passages show at the fidelity check, and set the
check's threshold (--blend-max-deviation auto) a margin above it.

The deviation a chunk shows (blend/fidelity.py) depends on the model: on SmolLM2 real passages show 0.03-0.06
at layer 1, a random 4-layer test checkpoint 0.1-0.5. Calibration takes the chats the key shift is calibrated
on (plain prose, one paragraph per text part: key_shift_calibration.calibration_chats), computes each whole,
computes each paragraph alone after the chat's opening as a precomputed document is, moves those K/V where the
paragraph sits in the chat exactly as the Blender does (re-RoPE, plus the key shift where it is on) and
measures the paragraph's deviation at the first check layer, which is what the check will see when that
paragraph is reused there (the check layer's fresh K/V is the whole prompt's: every reused token is computed
up to it). The threshold is MARGIN times the largest. The deviations are kept on disk beside the key shift.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from blend.fidelity import ChunkDeviation
from blend.key_shift import KeyShift, moved_keys

from reuse_server.engine.blender import layer_inv_freq
from reuse_server.engine.key_shift_calibration import cache_path, calibration_chats, fitted, scratch_prefill

log = logging.getLogger(__name__)

FIDELITY_CALIBRATION_VERSION = 1
# Measured at layer 1 (benchmarks/bench_blend_fidelity.py). SmolLM2: real reordered passages 0.034-0.056, the
# calibration paragraphs up to 0.058; garbage from 0.18 (a repeated word) and 0.23 (a passage filed after
# another prefix). Gemma 3 270M: real 0.089-0.124, garbage 0.15 and 0.19. 1.5 times the largest calibration
# deviation falls between the two on SmolLM2 (0.087) with room on both sides.
MARGIN = 1.5


@torch.inference_mode()
def measure(model, tokenizer, dtype: torch.dtype, device, check_layer: int,
            key_shift: KeyShift | None) -> list[float]:
    """The deviation at check_layer of every calibration paragraph that had another before it."""
    cfg = model.config
    inv_freq = layer_inv_freq(model)
    opening, chats = calibration_chats(tokenizer)
    devs = []
    for passages in fitted(opening, chats, cfg.max_position_embeddings):
        whole = scratch_prefill(model, opening + [t for p in passages for t in p], dtype, device)
        start = len(opening) + len(passages[0])
        for p in passages[1:]:
            n = len(p)
            alone = scratch_prefill(model, opening + p, dtype, device)
            slots = torch.arange(len(opening), len(opening) + n, device=device)
            alone.update_keys(slots, moved_keys(slots.cpu(), torch.arange(start, start + n), inv_freq, key_shift))
            old_k, old_v = alone.read(check_layer, slots)
            new_k, new_v = whole.read(check_layer, torch.arange(start, start + n, device=device))
            dev = ChunkDeviation(1)
            dev.add(torch.zeros(n, dtype=torch.long), old_k, new_k, old_v, new_v)
            devs.append(float(dev.deviation()[0]))
            start += n
    return devs


def threshold_path(model_path: Path, tokenizer, dtype: torch.dtype, check_layer: int, shifted: bool,
                   cache_dir: Path | None = None) -> Path:
    """Beside the key shift's file (the same model, dtype and calibration text), one per check layer and
    key shift setting."""
    shift_file = cache_path(model_path, tokenizer, dtype, cache_dir)
    return shift_file.with_name(f"{shift_file.stem}-fidelity-v{FIDELITY_CALIBRATION_VERSION}-l{check_layer}"
                                f"-{'shift' if shifted else 'noshift'}.json")


def load_or_calibrate_threshold(model, tokenizer, model_path: Path, dtype: torch.dtype, device, check_layer: int,
                                key_shift: KeyShift | None, cache_dir: Path | None = None) -> float:
    path = threshold_path(model_path, tokenizer, dtype, check_layer, key_shift is not None, cache_dir)
    try:  # the deviations are kept, not the threshold: a new MARGIN needs no new calibration
        return MARGIN * max(float(d) for d in json.loads(path.read_text())["deviations"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged file is recomputed, not fatal
        log.warning("ignoring unreadable fidelity calibration %s: %s", path, exc)
    log.info("calibrating the blending fidelity check (once per model)")
    devs = measure(model, tokenizer, dtype, device, check_layer, key_shift)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"check_layer": check_layer, "deviations": devs}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the fidelity calibration in %s: %s", path, exc)
    return MARGIN * max(devs)
