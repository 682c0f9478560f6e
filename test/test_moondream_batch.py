"""Several images encoded in one batch equal the images encoded one by one, and the batcher
gathers concurrent requests (several cameras on one engine) into batches."""
import threading

import numpy as np
import torch

from moondream_fixtures import model
from photon_core.runtime.batcher import EncodeBatcher


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [(60, 80), (378, 378), (300, 900), (120, 40)]
    return [rng.integers(0, 256, (*sizes[i % 4], 3), dtype=np.uint8) for i in range(n)]


def test_batched_encoding_equals_single():
    m = model()
    batch = m.encode_images(images(3))
    for enc, image in zip(batch, images(3)):
        single = m.encode_image(image)
        assert enc.tiling == single.tiling and enc.pos == single.pos
        torch.testing.assert_close(enc.k, single.k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(enc.v, single.v, rtol=1e-4, atol=1e-5)
        assert m.detect(enc, "cup", max_objects=2) == m.detect(single, "cup", max_objects=2)


def test_batcher_gathers_concurrent_requests():
    m = model()
    batcher = EncodeBatcher(m.encode_images, threading.Lock(), max_batch=8, window_s=0.5)
    frames = images(4, seed=1)
    results = [None] * 4

    def ask(i):
        results[i] = batcher.encode(frames[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sum(batcher.sizes) == 4 and batcher.batches < 4 and max(batcher.sizes) > 1
    for frame, enc in zip(frames, results):
        torch.testing.assert_close(enc.k, m.encode_image(frame).k, rtol=1e-4, atol=1e-5)


def test_batcher_reports_errors_to_each_caller():
    def broken(images):
        raise ValueError("image has zero size")
    batcher = EncodeBatcher(broken, threading.Lock())
    try:
        batcher.encode(np.zeros((0, 0, 3), np.uint8))
    except ValueError as err:
        assert "zero size" in str(err)
    else:
        raise AssertionError("the error was swallowed")
