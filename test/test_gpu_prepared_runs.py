"""The prepared GPU runs (bench/gpu.sh and what it calls) on the CPU: what they hand the compile pool,
how they build, what they keep when a part fails or the run is killed, what they free, which
bandwidth their floors use, and how many files they leave for the device tool to bring back. Tiny
shapes under Triton's interpreter; no GPU, nothing timed."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# What the device tool brings back from $OUT: at most 8 files, each named in letters, digits, '.',
# '_' and '-' (/work/.library/device/README.md, "Limits").
FILES_BACK = 8
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod      # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gt():
    return _load("gpu_timeline")


@pytest.fixture(scope="module")
def fams(gt):
    return gt.families(True, 4)


@pytest.fixture
def fresh(gt, tmp_path):
    """gpu_timeline's module state emptied, its saves going to tmp_path."""
    gt.RESULTS.clear()
    gt.TRACES.clear()
    if hasattr(gt, "OUT"):
        gt._SAVED_TRACES[0] = -1
        gt.OUT[:] = [tmp_path]
    yield tmp_path
    gt.RESULTS.clear()
    gt.TRACES.clear()
    if hasattr(gt, "OUT"):
        gt.OUT[:] = []


class RecordingPool:
    """What Prewarm.submit does with a kernel, without the processes: its warm-up spec."""

    def __init__(self) -> None:
        self.jobs: dict = {}

    def submit(self, kernel, dtypes, label):
        from photon_core.gpu_proof.prewarm import warmup_spec
        keys = [warmup_spec(kernel, dt) for dt in dtypes]
        for k in keys:
            self.jobs[k] = label
        return keys


def test_the_pool_gets_the_traced_build_the_run_launches(gt, fams):
    """A traced build is handed to the pool as the launch Megakernel.launch makes (warmup_spec asks
    the kernel's expert_loop of every launch passing XLOOP): the spec of the traced launch, not an
    AttributeError recorded as a failed compile."""
    from photon_core.megakernel.kernel import KernelVariant
    make, prod, _ = fams["whisper-tiny.en"]
    cfg = gt.Config("whisper-tiny.en B1 prod", make(prod), 1, torch.device("cpu"))
    pool = RecordingPool()
    plain = KernelVariant()
    keys = gt.submit_compiles(pool, cfg, [plain], [plain])
    assert len(keys) == 2 and set(keys) == set(pool.jobs)
    labels = {pool.jobs[k]: dict(k[1]) for k in keys}
    traced, untraced = labels["whisper-tiny.en B1 prod plain traced"], labels["whisper-tiny.en B1 prod plain"]
    assert traced["TRACE"] != ("value", 0) and untraced["TRACE"] == ("value", 0)
    # the weights as the pool compiles them (bf16), and XLOOP for a bf16 arena
    k = cfg.kernel(plain)
    assert traced["XLOOP"] == untraced["XLOOP"] == ("value", k.expert_loop(2))
    assert keys[0][0][4] == ("tensor", "bfloat16")


def test_steps_are_built_with_fp32_caches(gt, fams, monkeypatch):
    """On CUDA a step built outside cuda_kv_dtype gets bf16 caches; the timeline's floors and the
    first run's figures are for fp32 ones: each config builds under cuda_kv_dtype(fp32)."""
    from photon_core.megakernel import compiler
    assert compiler._cuda_kv_dtype[0] == torch.bfloat16      # what a bare build on CUDA would get
    make, prod, _ = fams["whisper-tiny.en"]
    fam = make(prod)
    seen = []
    real = fam.build

    def build(*a, **k):
        seen.append(compiler._cuda_kv_dtype[0])
        return real(*a, **k)
    monkeypatch.setattr(fam, "build", build)
    cfg = gt.Config("whisper-tiny.en B1 prod", fam, 1, torch.device("cpu"))
    assert seen == [torch.float32] and compiler._cuda_kv_dtype[0] == torch.bfloat16
    # the floor reads K/V at the caches' element size: bf16 caches would read half the K/V bytes
    from types import SimpleNamespace
    step = cfg.step
    weights = step.weight_bytes_per_step()

    def as_kv(dtype):
        return SimpleNamespace(weight_bytes_per_step=step.weight_bytes_per_step, graph_def=step.graph_def,
                               plan=SimpleNamespace(kv_dtype=dtype))
    kv32 = gt.floor_bytes_of(as_kv(torch.float32), cfg.rows) - weights
    kv16 = gt.floor_bytes_of(as_kv(torch.bfloat16), cfg.rows) - weights
    assert kv32 > 0 and kv16 * 2 == kv32
    assert gt.floor_bytes_of(step, cfg.rows) == weights + kv32       # this step's caches: fp32


def test_traces_come_first_and_a_failing_variant_spares_the_rest(gt, fams, fresh):
    """measure: the traced launches run before any variant is timed; a variant that fails (the
    prefetch build is GPU code: the interpreter refuses it) is recorded and the next one runs."""
    from photon_core.megakernel import timeline
    from photon_core.megakernel.kernel import KernelVariant
    make, prod, _ = fams["whisper-tiny.en"]
    cfg = gt.Config("whisper-tiny.en B1 prod", make(prod), 1, torch.device("cpu"))
    timed_before_trace = []
    real = timeline.analyse

    def analyse(*a, **k):
        timed_before_trace.append(len(gt.RESULTS.get("timing", [])))
        return real(*a, **k)
    plain, aligned = KernelVariant(), KernelVariant(aligned=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timeline, "analyse", analyse)
        gt.measure(cfg, [plain, KernelVariant(prefetch=1), aligned], [plain], 4e12, False, 1, perop=False)
    assert timed_before_trace == [0]
    assert [r["variant"] for r in gt.RESULTS["timing"]] == ["plain", "aligned"]
    assert [f["part"] for f in gt.RESULTS["failures"]] == ["whisper-tiny.en B1 prod prefetch1"]
    assert set(gt.RESULTS["timelines"]) == {"whisper-tiny.en B1 prod.plain"}


def test_a_killed_measure_keeps_every_row_it_finished(gt, fams, fresh, monkeypatch):
    """Rows are saved as they finish (json and traces, each written whole then renamed): a kill in
    the second variant's replays (KeyboardInterrupt, as the kill would) leaves the trace and the
    first variant's row on disk."""
    from photon_core.megakernel.kernel import KernelVariant
    make, prod, _ = fams["whisper-tiny.en"]
    cfg = gt.Config("whisper-tiny.en B1 prod", make(prod), 1, torch.device("cpu"))
    real, calls = gt.replay_us, []

    def second_is_killed(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(gt, "replay_us", second_is_killed)
    plain = KernelVariant()
    with pytest.raises(KeyboardInterrupt):
        gt.measure(cfg, [plain, KernelVariant(aligned=True)], [plain], 4e12, False, 1, perop=False)
    kept = json.loads((fresh / "gpu_timeline.json").read_text())
    assert [r["variant"] for r in kept["timing"]] == ["plain"]
    assert set(kept["timelines"]) == {"whisper-tiny.en B1 prod.plain"}
    import numpy as np
    with np.load(fresh / "traces.npz") as npz:
        assert set(npz.files) == {"whisper-tiny.en B1 prod.plain"}
    assert sorted(p.name for p in fresh.iterdir()) == ["gpu_timeline.json", "traces.npz"]   # no side file left


def test_a_dropped_config_frees_its_weights(gt, fams):
    """A config's family is a copy of the proof's family object: it must not share the dict its build
    puts the weights arena into (Moondream 3.1's ~18 GB stayed alive while span 4's was built), and
    the family's own fp32 copies go once the config has its bf16 arena."""
    if "moondream3" not in fams:
        pytest.skip("no Moondream 3.1 decode step in this tree")
    make, prod, _ = fams["moondream3"]
    fam = make(prod)
    arenas = []
    real = fam.build

    def build(*a, **k):
        step = real(*a, **k)
        arenas.append(weakref.ref(step.weights))
        return step
    fam.build = build
    cfg = gt.Config("moondream3 B1 bf16 experts", fam, 1, torch.device("cpu"))
    arenas.append(weakref.ref(cfg.step.weights))
    fam = cfg = build = real = None
    gc.collect()
    assert len(arenas) == 2 and all(r() is None for r in arenas)


@pytest.mark.parametrize("name, tbps", [("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H200", 4.8),
                                        ("NVIDIA H100 PCIe", 2.0)])
def test_the_floor_uses_the_devices_bandwidth(name, tbps):
    from photon_core.gpu_proof.hbm import DEFAULT_TBPS, hbm_tbps
    got, source = hbm_tbps(name)
    assert got == tbps and "UNKNOWN" not in source
    for unknown in ("NVIDIA H100 NVL", "NVIDIA GH200 480GB", "cpu (interpreter)"):
        got, source = hbm_tbps(unknown)
        assert got == DEFAULT_TBPS and "UNKNOWN" in source
    assert hbm_tbps(name, 1.5)[0] == 1.5


def _gpu_sh_out_files(mode: str, write: bool) -> set[str]:
    """What bench/gpu.sh itself names in $out for `mode`."""
    text = (BENCH / "gpu.sh").read_text()
    named = set(re.findall(r'"\$out/([A-Za-z0-9_.$-]+)"', text))
    assert {"gpu.log", "RESULTS.md", "gpu_bench.json", "gpu_proof_$mode.json"} <= named, named
    own = {"bench": {"gpu_bench.json"}, "timeline": set()}.get(mode, {f"gpu_proof_{mode}.json"})
    return {"gpu.log"} | own | ({"RESULTS.md"} if write else set())


@pytest.mark.parametrize("mode", ["timeline", "core", "others", "bench"])
def test_each_mode_leaves_no_more_files_than_come_back(mode, gt, fresh, tmp_path, monkeypatch):
    """Each gpu.sh mode's files in BENCH_OUT, from the code that names them (gpu.sh; the timeline's
    save; the proof's rounds children), with --write and a side file a kill could leave: at most what
    the device tool brings back. The rounds children (3 in `others`) write outside BENCH_OUT."""
    out = tmp_path / "out"
    out.mkdir()
    files = _gpu_sh_out_files(mode, write=True)
    if mode == "timeline":
        gt.RESULTS["x"] = 1
        gt.TRACES["a.plain"] = torch.zeros(2, 7, dtype=torch.int64).numpy()
        gt.save(out)
        files |= {p.name for p in out.iterdir()}
    elif mode in ("core", "others"):
        proof = _load("gpu_proof")
        from photon_core.gpu_proof.checks import PARTS
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
        args = proof.parse(["--profile", mode, "--json", str(out / f"gpu_proof_{mode}.json")])
        fams_, plans, _, _ = proof.select(False, mode, proof.families(True, 3), "", ",".join(PARTS))
        kids = proof.rounds_children(args, fams_, plans, 100.0)
        assert len(kids) == (3 if mode == "others" else 0)
        for c in kids:
            for path in (c.json_path, c.log_path):
                if path.parent == out:
                    files.add(path.name)
    files.add("results.json.tmp")         # a results file being rewritten when the kill came
    assert len(files) <= FILES_BACK, sorted(files)
    assert all(NAME_OK.match(f) for f in files), sorted(files)


def test_gpu_bench_keeps_what_it_finished(monkeypatch, tmp_path):
    """gpu_bench writes its json after the per-op part and after each batch, each batch guarded: a
    failing batch is recorded (and the exit status says so), a kill keeps the per-op rows."""
    bench = _load("gpu_bench")
    monkeypatch.setattr(bench, "bench_ops", lambda *a, **k: [dict(op="linear", triton_us=1.0, eager_us=2.0,
                                                                    rel_err=0.0)])

    def broken(*a, **k):
        raise RuntimeError("an illegal memory access")
    monkeypatch.setattr(bench, "bench_step", broken)
    path = tmp_path / "b.json"
    out = bench.main(["--dry-run", "--json", str(path)])
    kept = json.loads(path.read_text())
    assert [f["part"] for f in kept["failures"]] == ["decode step B1"] and kept["steps"] == []
    assert out["failures"] and kept["ops"][0]["op"] == "linear" and "UNKNOWN" in kept["hbm_source"]

    def killed(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_step", killed)
    path.unlink()
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--dry-run", "--json", str(path)])
    assert json.loads(path.read_text())["ops"][0]["op"] == "linear"


def test_gpu_bench_times_the_megakernel_on_fp32_caches_as_the_other_paths(monkeypatch):
    """On CUDA a megakernel step built without kv_dtype gets bf16 caches: gpu_bench checked it
    against the fp32 reference (its error was bf16's rounding, ~1e-3) and timed it against eager
    and per-op paths reading twice its cache bytes. Here the CPU builds as CUDA does."""
    from photon_core.megakernel import compiler
    from photon_core.models.whisper.decoder_step import Tiling, WhisperDecoderWeights
    bench = _load("gpu_bench")
    built = compiler.CompiledStep.__init__

    def as_on_cuda(self, *a, kv_dtype=None, **k):
        built(self, *a, kv_dtype=kv_dtype or compiler._cuda_kv_dtype[0], **k)
    monkeypatch.setattr(compiler.CompiledStep, "__init__", as_on_cuda)
    args = bench.parse(["--dry-run", "--sweep-block-n", "", "--no-bf16"])
    args.iters, args.warmup, args.hbm_tbps = 1, 0, 4.8
    torch.manual_seed(0)
    wt = WhisperDecoderWeights.random(64, 2, 1, 100, 8, seed=0, device=torch.device("cpu"))
    r = bench.bench_step(args, torch.device("cpu"), False, wt, 1, 8, 8, Tiling(64, 64, 16, 1, 1))
    assert r["kv_dtype"] == "torch.float32" and r["megakernel_rel_err"] < 1e-5, r


def test_a_results_file_is_replaced_whole_or_not_at_all(tmp_path):
    """Every GPU script writes its results through one rule (gpu_e2e wrote its own in place: a kill
    mid-write left it truncated)."""
    from photon_core.gpu_proof.results_file import replace_whole
    path = tmp_path / "deep" / "results.json"
    replace_whole(path, '{"done": 1}')
    assert json.loads(path.read_text()) == {"done": 1}

    def killed(f):
        f.write(b'{"done": ')
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        replace_whole(path, killed)
    assert json.loads(path.read_text()) == {"done": 1}
    replace_whole(path, b'{"done": 2}')
    assert json.loads(path.read_text()) == {"done": 2}
