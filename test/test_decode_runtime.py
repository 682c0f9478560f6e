"""photon_core.runtime's decode pieces on their own (no model, no Triton launch): the compiled
steps by bucket (dtype, length, one weights arena, built once, exclusive use, state binding),
sampling settings and the next-token pick, and text streaming over split UTF-8."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from photon_core.backends import reference
from photon_core.runtime import decode
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import JoinedPieces, text_pieces


class FakeStep:
    """A compiled step's face as CompiledSteps sees it: batch, weights, and the binding protocol."""

    def __init__(self, batch: int, weights: object | None) -> None:
        self.batch, self.weights = batch, weights if weights is not None else object()
        self.bound: object | None = None
        self.events: list[tuple[str, int]] = []

    def holds(self, state: object) -> bool:
        return self.bound is state

    def load_state(self, state: object) -> None:
        self.events.append(("load", id(state)))
        self.bound = state

    def release(self, state: object) -> None:
        self.events.append(("release", id(state)))
        self.bound = None


class Steps(decode.CompiledSteps[FakeStep]):
    family = "A toy model"

    def __init__(self) -> None:
        super().__init__(decode.decode_length(None, 64, 32), decode.resolve_weight_dtype(None, torch.float32, "cpu"))
        self.built: list[int] = []

    def build_step(self, batch: int, weights: object | None) -> FakeStep:
        self.built.append(batch)
        return FakeStep(batch, weights)

    def build_loop(self, step: FakeStep) -> str:
        return f"rounds of {step.batch}"


class State:
    pass


def test_bucket_for_refuses_rows_outside_the_buckets():
    for bad in (0, 9):
        with pytest.raises(ValueError, match="1 to 8"):
            decode.bucket_for(bad)


def test_weight_dtype_default_and_refusal():
    assert decode.resolve_weight_dtype(None, torch.float32, "cuda") is torch.bfloat16
    assert decode.resolve_weight_dtype(None, torch.float32, "cpu") is torch.float32
    assert decode.resolve_weight_dtype(None, torch.float16) is torch.float16   # no device: the model's
    assert decode.resolve_weight_dtype(torch.float16, torch.float32, "cuda") is torch.float16
    for bad in (torch.int8, torch.float64):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            decode.resolve_weight_dtype(bad, torch.float32, "cpu")


def test_decode_length():
    assert decode.decode_length(None, 1000, 256) == 256
    assert decode.decode_length(None, 100, 256) == 100
    assert decode.decode_length(None, 100) == 100
    assert decode.decode_length(50, 100, 256) == 50
    for bad in (1, 101):
        with pytest.raises(ValueError, match=r"max_len .* \[2, 100\]"):
            decode.decode_length(bad, 100, 256)


def test_triton_ops_required():
    decode.require_triton_ops(type("Ops", (), {"COMPILES_STEPS": True}), "Toy", "load_toy")
    for ops in (reference, type("Ops", (), {"NAME": "megakernel"})):   # by capability, not by name
        with pytest.raises(ValueError, match="Toy decode megakernel needs a model on the Triton ops"):
            decode.require_triton_ops(ops, "Toy", "load_toy")


def test_steps_built_once_per_bucket_on_the_first_weights():
    s = Steps()
    assert s.max_len == 32 and s.weight_dtype is torch.float32
    one = s.for_rows(1)
    four = s.for_rows(3)
    assert four.batch == 4 and four.weights is one.weights
    assert s.for_rows(4) is four and s.loop(4) == "rounds of 4"
    assert s.built == [1, 4]
    with pytest.raises(ValueError, match="not a bucket"):
        s.decoder(3)
    assert s.fits(8, 32) and not s.fits(9, 32) and not s.fits(1, 33)
    with pytest.raises(ValueError, match="exceeds the megakernel's caches"):
        s.check_fits(2, 33)


def test_a_failed_build_keeps_no_half_built_bucket():
    s = Steps()
    s.build_loop = lambda step: (_ for _ in ()).throw(RuntimeError("capture failed"))
    with pytest.raises(RuntimeError, match="capture failed"):
        s.decoder(2)
    assert 2 not in s._steps and 2 not in s._loops


def test_exclusive_use_refuses_its_own_thread_and_queues_others():
    """The arenas hold one request: the holder's own thread (a call inside a stream's loop) is
    refused at once; another thread waits its turn (as the moondream client queues), and gives up
    with the reason after its wait."""
    s = Steps()
    with s.exclusive():
        with pytest.raises(RuntimeError, match="A toy model on the megakernel decodes one request or batch at a time"):
            with s.exclusive():
                pass
        seen: list[BaseException] = []

        def impatient() -> None:
            try:
                with s.exclusive(wait_s=0.05):
                    pass
            except RuntimeError as e:
                seen.append(e)
        t = threading.Thread(target=impatient)
        t.start()
        t.join()
        assert len(seen) == 1 and "held them for over 0.05 s" in str(seen[0])
        served = threading.Event()

        def patient() -> None:
            with s.exclusive():
                served.set()
        t = threading.Thread(target=patient)
        t.start()
        time.sleep(0.1)
        assert not served.is_set()            # waiting for the first
    t.join(timeout=5)
    assert served.is_set()                    # its turn came when the first ended
    with s.exclusive():   # released after both
        pass


def _open_stream_in_a_thread_that_ends(s: Steps):
    """A stream (a generator holding exclusive() across its yields) started in a thread that then
    ends, the stream left open: (the stream, the ended thread)."""
    def stream():
        with s.exclusive():
            yield 1
            yield 2
    box = []

    def opener() -> None:
        g = stream()
        next(g)
        box.append(g)
    a = threading.Thread(target=opener)
    a.start()
    a.join()
    return box[0], a


def test_a_thread_with_an_ended_holders_id_is_not_taken_for_the_holder():
    """The holder was kept by thread id, which Linux reuses once a thread ends: a new thread given
    the id of the ended thread that opened a stream was refused at once as holding the arenas
    itself. It is another request: it waits its turn (here: gives up after its short wait)."""
    s = Steps()
    g, a = _open_stream_in_a_thread_that_ends(s)
    seen: list[str] = []

    def probe() -> None:
        if threading.get_ident() != a.ident:
            return
        try:
            with s.exclusive(wait_s=0.05):
                seen.append("served")
        except RuntimeError as e:
            seen.append(str(e))
    for _ in range(500):   # glibc hands an ended thread's id to a new thread within a few starts
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        if seen:
            break
    else:
        pytest.skip("no thread got the ended thread's id: the reuse this test needs did not happen")
    assert len(seen) == 1 and "held them for over 0.05 s" in seen[0] and "this thread holds them" not in seen[0]
    assert list(g) == [2]   # finishing the stream in another thread frees the arenas
    with s.exclusive(wait_s=5):
        pass


def test_a_call_inside_a_stream_consumed_in_another_thread_says_it_waits_for_itself(monkeypatch):
    """A stream opened in one thread and consumed in another holds the arenas under the opening
    thread, so a call inside its loop in the consuming thread waits (the arenas cannot tell it from
    another request): its error, after the wait, must say that it may be waiting for itself (it
    only blamed "another request", after 600 s)."""
    monkeypatch.setattr(decode, "EXCLUSIVE_WAIT_S", 0.1)
    s = Steps()
    g, a = _open_stream_in_a_thread_that_ends(s)
    seen: list[BaseException] = []

    def consumer() -> None:
        for _ in g:
            try:
                with s.exclusive():
                    pass
            except RuntimeError as e:
                seen.append(e)
    b = threading.Thread(target=consumer)
    started = time.monotonic()
    b.start()
    b.join(timeout=60)
    assert not b.is_alive() and time.monotonic() - started < 30   # the patched wait, not 600 s
    assert len(seen) == 1
    msg = str(seen[0])
    assert "held them for over 0.1 s" in msg and "the thread that opened it has ended" in msg
    assert "this thread is itself consuming an open stream" in msg
    with s.exclusive(wait_s=5):   # the stream ended in the consumer: nothing held
        pass


def test_binding_moves_the_previous_state_out_first():
    s = Steps()
    a, b = State(), State()
    with s.turn():
        step = s.bind(a, 1, 10)
        assert s.bind(a, 1, 10) is step and step.events == [("load", id(a))]   # already bound: nothing
        s.bind(b, 1, 10)
        s.bind(a, 1, 10)
    assert step.events == [("load", id(a)), ("release", id(a)), ("load", id(b)),
                           ("release", id(b)), ("load", id(a))]
    with pytest.raises(ValueError, match="9 rows exceed"):
        s.bind(State(), 9, 10)
    with pytest.raises(ValueError, match="40 positions exceeds"):
        s.bind(State(), 1, 40)


def test_sampling_settings_refused_with_reasons():
    assert Sampling(5).greedy and not Sampling(5, 0.7, 0.9).greedy
    with pytest.raises(ValueError) as err:
        Sampling(-1, -0.5, 0.0)
    msg = str(err.value)
    assert "max_tokens must be >= 0" in msg and "temperature must be >= 0" in msg and "top_p must be in (0, 1]" in msg
    for bad in ({"top_p": 1.5}, {"temperature": float("nan")}, {"temperature": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(4, **bad)


def test_pick_greedy_masked_and_seeded():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    allowed = torch.tensor([True, False, True, True])
    assert pick(logits, Sampling(1), reference) == 1
    assert pick(logits, Sampling(1), reference, allowed) == 3
    s = Sampling(1, temperature=1.0, top_p=1.0)
    draws = [pick(logits, s, reference, allowed, torch.Generator().manual_seed(i)) for i in range(200)]
    assert 1 not in draws and set(draws) <= {0, 2, 3} and len(set(draws)) >= 2
    again = [pick(logits, s, reference, allowed, torch.Generator().manual_seed(i)) for i in range(200)]
    assert draws == again
    # top_p small enough: only the most likely allowed token
    assert {pick(logits, Sampling(1, 1.0, 0.01), reference, allowed, torch.Generator().manual_seed(i))
            for i in range(20)} == {3}


def test_text_pieces_holds_back_a_character_split_across_tokens():
    # A byte-level vocabulary: "é" (C3 A9) and "😀" (F0 9F 98 80) span tokens.
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b" ", 4: b"\xf0\x9f", 5: b"\x98", 6: b"\x80", 7: b"!"}

    def dec(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
    pieces = list(text_pieces(dec, [0, 1, 2, 3, 4, 5, 6, 7]))
    assert pieces == ["caf", "é", " ", "😀", "!"]
    assert all("\ufffd" not in p for p in pieces)
    # A stream ending inside a character gives what the tokenizer says for it.
    assert "".join(text_pieces(dec, [0, 1])) == dec([0, 1])
    assert list(text_pieces(dec, [])) == []


def test_joined_pieces_is_text_pieces_joined_at_every_length_with_one_decode_a_token():
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b" ", 4: b"\xf0\x9f", 5: b"\x98", 6: b"\x80", 7: b"!"}
    calls = []

    def dec(ids):
        calls.append(len(ids))
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
    rng = np.random.default_rng()
    for _ in range(20):
        tokens = [int(t) for t in rng.integers(0, 8, int(rng.integers(0, 12)))]
        joined = JoinedPieces(dec)
        for n in range(len(tokens) + 1):
            calls.clear()
            got = joined.text(tokens[:n])
            assert len(calls) == 1                  # one decode a new token (it was two)
            assert got == "".join(text_pieces(dec, tokens[:n]))
        calls.clear()
        joined.text(tokens)
        assert len(calls) == 1                      # a report without a new token: one decode
    assert JoinedPieces(dec).text([0, 1]) == dec([0, 1])
    # a progress report (more tokens may come) shows no unfinished character, as the pieces do
    progress = JoinedPieces(dec)
    assert progress.text([0, 1], final=False) == "caf" and progress.text([0, 1, 2], final=False) == "café"
    assert progress.text([0, 1, 2, 3, 4], final=False) == "café " and progress.text([0, 1, 2, 3, 4]) == dec([0, 1, 2, 3, 4])
    other = JoinedPieces(dec)
    other.text([0, 3, 7])
    assert other.text([7, 7]) == "!!"               # not a continuation: started again


def test_text_pieces_is_lazy():
    pulled: list[int] = []

    def tokens():
        for t in (0, 3, 7):
            pulled.append(t)
            yield t
    it = text_pieces(lambda ids: "".join("abc"[i % 3] for i in ids), tokens())
    assert next(it) == "a" and pulled == [0]


class ScriptSession:
    """A session whose rows follow fixed token scripts (row r's k-th greedy token is script[r][k]):
    the logits put all mass on that token; `rounds` replays the scripts as device rounds would."""

    V = 16

    def __init__(self, scripts: list[list[int]]) -> None:
        self.scripts, self.live = scripts, list(range(len(scripts)))
        self.fed = [0] * len(scripts)
        self.kept: list[list[int]] = []

    def _logits(self) -> torch.Tensor:
        out = torch.full((len(self.live), self.V), -10.0)
        for i, r in enumerate(self.live):
            out[i, self.scripts[r][self.fed[r]]] = 10.0
        return out

    def prefill(self):
        return self._logits(), None

    def step(self, tokens):
        assert len(tokens) == len(self.live)
        for r, t in zip(self.live, tokens):
            assert t == self.scripts[r][self.fed[r]]   # each row is fed its own last token
            self.fed[r] += 1
        return self._logits(), None

    def keep(self, rows):
        self.kept.append(rows)
        self.live = [self.live[i] for i in rows]


class RoundSession(ScriptSession):
    def rounds(self, first, max_new, stop):
        for r, t in enumerate(first):   # step-major, as DeviceDecode.stream yields
            assert t == self.scripts[r][0]
        k, going = 0, [n > 0 and first[r] not in stop for r, n in enumerate(max_new)]
        while any(going):
            for r in range(len(first)):
                if going[r]:
                    t = self.scripts[r][k]
                    if t in stop:
                        going[r] = False
                        continue
                    yield r, t
                    if k + 1 == max_new[r]:
                        going[r] = False
            k += 1


def _greedy(r, logits, greedy):
    return pick(logits, Sampling(1), reference)


def test_generate_stops_rooms_keep_and_cancel():
    from photon_core.runtime.generate import generate, room
    assert room(10, 20, 25) == 6 and room(3, 20, 25) == 3 and room(5, 30, 25) == 0
    scripts = [[1, 2, 0, 9], [3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10]]
    s = ScriptSession(scripts)
    settings = [Sampling(10), Sampling(10), Sampling(2)]
    steps = list(generate(s, settings, [10, 4, 2], {0}, _greedy))
    assert steps == [[1, 3, 5], [2, 4, 6], [None, 5, None], [None, 6, None]]
    assert s.kept == [[0, 1], [1]]   # row 2 leaves at its max_tokens, then row 0 at its stop token
    # a canceled row stops before its next token; nothing left: no step at all
    s = ScriptSession(scripts)
    steps = list(generate(s, settings, [10, 4, 2], {0}, _greedy, canceled=lambda r: r == 1 and s.fed[1] >= 1))
    assert steps == [[1, 3, 5], [2, None, 6]]
    assert list(generate(ScriptSession(scripts), settings, [0, 0, 0], {0}, _greedy)) == []
    with pytest.raises(ValueError, match="one room per row"):
        list(generate(ScriptSession(scripts), settings, [1, 1], {0}, _greedy))
    # rooms are read at each step: a choice may shorten its row's (Moondream: a reasoning's answer
    # gets its own max_tokens when it starts); the row ends once it has taken the new room
    rooms = [10, 10, 10]

    def shorten(r, logits, greedy):
        tok = _greedy(r, logits, greedy)
        if r == 1 and tok == 4:
            rooms[1] = 3
        return tok
    scripts = [[1, 2, 0], [3, 4, 5, 6, 7, 8, 9, 10, 11], [0]]
    steps = list(generate(ScriptSession(scripts), [Sampling(10)] * 3, rooms, {0}, shorten))
    assert steps == [[1, 3, None], [2, 4, None], [None, 5, None]]


def test_generate_on_device_rounds_gives_the_host_loops_steps():
    from photon_core.runtime.generate import generate
    scripts = [[1, 2, 0, 9], [3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1, 1]]
    settings = [Sampling(10)] * 4
    rooms = [10, 4, 2, 3]
    host = list(generate(ScriptSession(scripts), settings, rooms, {0}, _greedy, device_rounds=True))
    device = list(generate(RoundSession(scripts), settings, rooms, {0}, _greedy, device_rounds=True))
    assert device == host == [[1, 3, 5, None], [2, 4, 6, None], [None, 5, None, None], [None, 6, None, None]]
    # sampled rows never take the rounds
    sampled = [Sampling(10, 0.5, 1.0)] * 4
    s = RoundSession(scripts)
    s.rounds = None
    assert list(generate(s, sampled, rooms, {0}, _greedy)) == host


def test_prefilled_kv_lands_in_its_rows_and_positions_only():
    """copy_prefilled_kv into a layered region (kcache [L, B, H, T, D]) and into per-layer caches
    of their own lengths: the rows and positions asked for take the prefill (cast to the step's
    dtype), everything else keeps its NaN; what does not fit is refused before anything is written."""
    L, B, H, T, D = 2, 4, 2, 8, 3
    views = {"kcache": torch.full((L, B, H, T, D), float("nan")), "vcache": torch.full((L, B, H, T, D), float("nan")),
             "L0.k": torch.full((B, H, T, D), float("nan")), "L0.v": torch.full((B, H, T, D), float("nan")),
             "L1.k": torch.full((B, H, 4, D), float("nan")), "L1.v": torch.full((B, H, 4, D), float("nan"))}
    step = type("Step", (), {"view": lambda self, name: views[name]})()
    kv = [(torch.randn(2, H, T, D, dtype=torch.float64), torch.randn(2, H, T, D, dtype=torch.float64))
          for _ in range(L)]
    decode.copy_prefilled_kv(step, ("kcache", "vcache"), kv, slice(1, 3), 5)
    for i in range(L):
        assert torch.equal(views["kcache"][i, 1:3, :, :5], kv[i][0][:, :, :5].float())
        assert torch.equal(views["vcache"][i, 1:3, :, :5], kv[i][1][:, :, :5].float())
    assert views["kcache"][:, 1:3, :, 5:].isnan().all() and views["kcache"][:, [0, 3]].isnan().all()
    short = {0: (torch.ones(1, H, 6, D), 2 * torch.ones(1, H, 6, D)), 1: (torch.ones(1, H, 4, D), torch.ones(1, H, 4, D))}
    decode.copy_prefilled_kv(step, lambda i: (f"L{i}.k", f"L{i}.v"), short, slice(2, 3))   # every position held
    assert (views["L0.v"][2, :, :6] == 2).all() and views["L0.v"][2, :, 6:].isnan().all()
    assert (views["L1.k"][2] == 1).all() and views["L1.k"][[0, 1, 3]].isnan().all()
    too_long = {1: (torch.ones(1, H, 5, D), torch.ones(1, H, 5, D))}
    with pytest.raises(ValueError, match=r"1 rows x 5 positions do not fit .* layer 1's cache \[4 rows, 4 positions\]"):
        decode.copy_prefilled_kv(step, lambda i: (f"L{i}.k", f"L{i}.v"), too_long, slice(0, 1))
    with pytest.raises(ValueError, match="2 rows"):
        decode.copy_prefilled_kv(step, ("kcache", "vcache"), kv, slice(3, 4))
