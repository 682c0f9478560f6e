"""A request's progress callback that raises (the ROS vision action's feedback publisher, gone at
shutdown) costs only its own reports: it is logged once and not called again, and the batch decodes
on, every request's result the one it gives without callbacks (Gemma 4, Moondream, Qwen 3.5)."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import pytest

import test_qwen3_5_fixtures as qwen_fx
from moondream_fixtures import model as moondream_model
from test_gemma4_fixtures import gemma4_dir, gemma4_hf  # noqa: F401  (fixtures)

from photon_core.runtime.requests import Request

LOGGER = "photon_core.runtime.batch_rows"
GREEDY = {"temperature": 0, "max_tokens": 6}


def check_a_raising_callback_costs_only_its_reports(batch: Callable[[list[Request]], list[dict]], a: Request,
                                                    b: Request, caplog: pytest.LogCaptureFixture) -> None:
    want = batch([a, b])
    told: list[list[dict]] = [[], []]
    assert batch([dataclasses.replace(a, progress=told[0].append),
                  dataclasses.replace(b, progress=told[1].append)]) == want
    assert len(told[0]) > 1 and len(told[1]) > 1   # both grow step by step: more reports were due

    raised, heard = [], []

    def gone(partial: dict) -> None:
        raised.append(partial)
        raise RuntimeError("feedback publisher gone")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        got = batch([dataclasses.replace(a, progress=gone), dataclasses.replace(b, progress=heard.append)])
    assert got == want
    assert raised == told[0][:1]   # not called again once it raised
    assert heard == told[1]        # the other request heard all of its own
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 1 and "feedback publisher gone" in (logged[0].exc_text or "")


def test_gemma4(gemma4_dir, caplog):  # noqa: F811
    from photon_core.models.gemma4 import load_gemma4
    model = load_gemma4(gemma4_dir)
    check_a_raising_callback_costs_only_its_reports(
        model.batch, Request("query", None, "what is in this image?", settings=GREEDY),
        Request("query", None, "the cat sat on the mat", settings=GREEDY), caplog)


def test_moondream(caplog):
    model = moondream_model()
    image = np.random.default_rng(3).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    check_a_raising_callback_costs_only_its_reports(
        model.batch, Request("caption", image, "short", max_tokens=6),
        Request("detect", image, "cup", max_objects=3), caplog)


def test_qwen3_5(tmp_path, caplog):
    from photon_core.models.qwen3_5 import load_qwen3_5
    qwen_fx.build(tmp_path, "deltas3", seed=1)
    model = load_qwen3_5(tmp_path)
    check_a_raising_callback_costs_only_its_reports(
        model.batch, Request("query", None, "what is in the picture?", settings=GREEDY),
        Request("query", None, "describe the fox", settings=GREEDY), caplog)
