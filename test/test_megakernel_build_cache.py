"""The megakernel build cache (photon_core/megakernel/build_cache.py): a step built a second time
reads its task graph and table from disk and lowers, checks and encodes nothing (calls counted,
not timed); what it reads is byte for byte what a build gives, whatever the weights' values (they
never reach the table); everything the table depends on is in the key; a corrupt entry is rebuilt
with a warning; the folder is the one the environment names (here always a temporary one)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import build_cache, checker, compiler, graph_file  # noqa: E402
from photon_core.megakernel.compiler import CompiledStep, Tiling, lower, plan  # noqa: E402
from photon_core.megakernel.graph import TaskGraph  # noqa: E402
from photon_core.megakernel.stepgraph import Value  # noqa: E402
from test_megakernel_compiler import fill_caches, toy_graph, toy_weights  # noqa: E402

# Split-K tiles (tile tickets), stage tickets and rotary appends as finale rows: every field of a
# task and of a graph is in the entry.
TILING = Tiling(32, 16, 8, 2, 2, min_tasks=40, min_block_n=8, max_split_k=3, rope_finale_rows=4)
LOGGER = "photon_core.megakernel.build_cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache on (test/conftest.py turns it off for the suite), in this test's folder."""
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path))
    return tmp_path / "megakernel"


@pytest.fixture
def builds(monkeypatch):
    """Calls of lower, checker.check (Megakernel's constructor imports it when it runs) and
    TaskGraph.encode, counted."""
    calls = {"lower": 0, "check": 0, "encode": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(compiler, "lower", counted("lower", compiler.lower))
    monkeypatch.setattr(checker, "check", counted("check", checker.check))
    monkeypatch.setattr(TaskGraph, "encode", counted("encode", TaskGraph.encode))
    return calls


def step(seed=0, batch=2):
    w = toy_weights(seed=seed)
    return CompiledStep(toy_graph(w), w, batch, TILING)


def test_a_second_build_reads_the_table_and_builds_nothing(cache, builds):
    first = step()
    assert builds == {"lower": 1, "check": 1, "encode": 1}
    assert first.graph.rows and any(t.kticket for t in first.graph.tasks)   # what TILING is for
    assert len(list(cache.glob("*.safetensors"))) == 1
    # Another checkpoint of the same shapes (other values): its step is read, not built.
    second = step(seed=1)
    assert builds == {"lower": 1, "check": 1, "encode": 1}
    assert torch.equal(second.kernel.tasks, first.kernel.tasks)
    assert second.graph == first.graph   # every task's accesses too, not only the table
    # ... and the table read is the one a build with these values gives: values never enter it.
    assert torch.equal(second.kernel.tasks, lower(plan(second.graph_def, 2, TILING)).encode())
    # The kernel read is the one the constructor makes: the same attributes, the same values.
    built, read = vars(first.kernel), vars(second.kernel)
    assert built.keys() == read.keys()
    for name, value in built.items():
        if name in ("weights", "state", "dyn", "out"):   # each step's own buffers
            assert read[name] is getattr(second, name), name
        elif isinstance(value, torch.Tensor):
            assert torch.equal(read[name], value) and read[name].dtype == value.dtype, name
        else:
            assert read[name] == value, name

    # A pruned kernel: built once, then read.
    calls = dict(builds)
    first.kernel_for(("left",))
    assert builds["lower"] == calls["lower"] + 1 and len(list(cache.glob("*.safetensors"))) == 2
    third = step()
    pruned = third.kernel_for(("left",))
    assert builds["lower"] == calls["lower"] + 1 and builds["check"] == calls["check"] + 1
    assert torch.equal(pruned.tasks, first.kernel_for(("left",)).tasks)

    # The kernel read runs the step as the built one does, bit for bit.
    for s in (first, third):
        gen = torch.Generator().manual_seed(5)
        s.state.fill_(float("nan"))
        fill_caches(s, 2, [3, 5], 9, gen)
        s.set_cross_len([9, 7])
        s.set_input("bias", torch.zeros(2, 70))
        s.set_step([4, 60], [3, 5])
        s.launch()
    assert torch.equal(third.out, first.out)
    assert torch.equal(third.view("logits"), first.view("logits"))
    assert builds["lower"] == calls["lower"] + 1   # launching read no graph either


def test_the_key_holds_everything_the_table_depends_on(cache, monkeypatch, caplog, tmp_path):
    w = toy_weights()

    def key(g=None, batch=2, tiling=TILING, wd=torch.float32, kv=torch.float32, results=None, dev="cpu"):
        return build_cache.entry_key(g if g is not None else toy_graph(w), batch, tiling, wd, kv, results,
                                     torch.device(dev))

    def edited(edit):
        g = toy_graph(w)
        edit(g)
        return g

    def eps(g):   # the smallest change of a float constant: its next representable value
        for n in g.nodes:
            if n.op == "layer_norm":
                n.args["eps"] = math.nextafter(n.args["eps"], 1.0)

    def foreign(g):   # the same name and width, but not the object its producer defined
        node = next(n for n in g.nodes if n.op == "linear" and n.args["residual"] is not None)
        node.args["residual"] = Value(node.args["residual"].name, node.args["residual"].width)

    base = key()
    assert base is not None and base == key(toy_graph(toy_weights(seed=3)))   # values are not in it
    variants = {
        "batch": key(batch=4), "tiling": key(tiling=dataclasses.replace(TILING, block_k=32)),
        "weight dtype": key(wd=torch.bfloat16), "kv dtype": key(kv=torch.bfloat16),
        "results": key(results=frozenset({"left"})), "shapes": key(toy_graph(toy_weights(vocab=71))),
        "a constant's last bit": key(edited(eps)), "which object an op reads": key(edited(foreign)),
        "the model's name": key(edited(lambda g: setattr(g, "name", "toy2"))),
        "the weights' order (arena layout)": key(edited(lambda g: setattr(
            g, "weight_shapes", dict(reversed(list(g.weight_shapes.items())))))),
        "device": key(dev="meta"),
    }
    with monkeypatch.context() as m:
        m.setattr(build_cache, "_triton_version", lambda: "0.0.0")
        variants["Triton"] = key()
    # The code: one byte of a lowering rule edited in a copy of the sources.
    src = tmp_path / "src"
    shutil.copytree(build_cache.PACKAGE, src / "megakernel", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "kernels").mkdir()
    extra = tuple(src / "kernels" / p.name for p in build_cache.EXTRA_SOURCES)
    for p in build_cache.EXTRA_SOURCES:
        shutil.copy(p, src / "kernels")
    try:
        with monkeypatch.context() as m:
            m.setattr(build_cache, "PACKAGE", src / "megakernel")
            m.setattr(build_cache, "EXTRA_SOURCES", extra)
            build_cache.code_version.cache_clear()
            assert key() == base   # the same sources elsewhere: the same code
            for rule, what in ((src / "megakernel" / "ops" / "linear.py", "the lowering's source"),
                               (src / "kernels" / "linear.py", "the activation codes' source"),
                               (src / "kernels" / "triton_versions.py", "the kernel's tuning (its expert steps)")):
                rule.write_text(rule.read_text() + "\n")
                build_cache.code_version.cache_clear()
                variants[what] = key()
    finally:
        build_cache.code_version.cache_clear()
    assert key() == base
    assert None not in variants.values()
    assert len(set(variants.values()) | {base}) == len(variants) + 1, variants

    # An argument it cannot state exactly: no key (built at every start, with a warning), not a loose one.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert key(edited(lambda g: g.nodes[0].args.update(scale=np.float32(1.0)))) is None
    assert "cannot state float32" in caplog.text
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "0")
    assert key() is None


def _flip_a_table_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + size])["table"]["data_offsets"]
    data[8 + size + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "a table byte flipped", "another key's entry"])
def test_a_corrupt_entry_is_rebuilt_with_a_warning(cache, builds, caplog, damage):
    first = step()
    [entry] = cache.glob("*.safetensors")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:entry.stat().st_size // 2])
    elif damage == "not safetensors":
        entry.write_bytes(b"\xff" * 64)
    elif damage == "a table byte flipped":
        _flip_a_table_byte(entry)
    else:
        step(batch=1)
        other = next(p for p in cache.glob("*.safetensors") if p != entry)
        shutil.copy(other, entry)
    calls = dict(builds)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = step()
    assert builds == {k: v + 1 for k, v in calls.items()}, "the entry was used, not rebuilt"
    assert "ignoring" in caplog.text and entry.name in caplog.text
    assert torch.equal(again.kernel.tasks, first.kernel.tasks)
    step()   # the rebuild replaced the entry: the next start reads it
    assert builds == {k: v + 1 for k, v in calls.items()}


def test_a_cache_that_cannot_be_written_costs_only_the_cache(tmp_path, monkeypatch, builds, caplog):
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(blocked))   # its "megakernel" folder cannot be made
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = step()
    assert "could not write" in caplog.text and builds["lower"] == 1
    # A write that fails half-way leaves neither an entry nor its temporary file.
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / "cache"))

    def fails(path, *args):
        path.write_bytes(b"half")
        raise OSError("no space left on device")
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger=LOGGER):
        m.setattr(graph_file, "write", fails)
        step()
    assert list((tmp_path / "cache" / "megakernel").iterdir()) == []
    step()
    assert [p.suffix for p in (tmp_path / "cache" / "megakernel").iterdir()] == [".safetensors"]
    assert torch.equal(step().kernel.tasks, first.kernel.tasks)


def test_a_cache_folder_that_cannot_be_opened_costs_only_the_cache(tmp_path, monkeypatch, builds, caplog):
    """stat() refusing the folder (a name too long here; another user's 0700 folder alike) is a miss
    and a warning: the step builds."""
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / ("x" * 300)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        built = step()
    assert builds["lower"] == 1 and "could not write" in caplog.text and built.kernel.tasks.numel() > 0


def test_where_the_cache_lives(tmp_path, monkeypatch):
    for name in ("PHOTON_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build_cache.cache_dir() == tmp_path / "home" / ".cache" / "photon" / "megakernel"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build_cache.cache_dir() == tmp_path / "xdg" / "photon" / "megakernel"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "volume" / "triton"))   # beside Triton's
    assert build_cache.cache_dir() == tmp_path / "volume" / "photon" / "megakernel"
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / "mine"))
    assert build_cache.cache_dir() == tmp_path / "mine" / "megakernel"
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "0")
    assert build_cache.cache_dir() is None


def test_another_process_stores_the_table_this_one_builds(cache, tmp_path):
    """Lowering is deterministic across processes (string hashing differs per process): the table
    a start stored is the one this process builds."""
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, sys.argv[1]); "
            "from test_megakernel_build_cache import step; step()")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [entry] = cache.glob("*.safetensors")
    graph, table, _ = graph_file.read(entry)
    w = toy_weights()
    built = lower(plan(toy_graph(w), 2, TILING))
    assert graph == built and torch.equal(table, built.encode())


def test_every_family_states_its_step_graph_the_same_in_every_process():
    """A graph whose weights or nodes come out in another order in another process (a set iterated:
    string hashing differs per process) has another arena layout there, so another key: its entry
    would never be read. Each family's graph at real sizes (bench/start.py's), in two processes."""
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/bench']; import start; "
            "from photon_core.megakernel.build_cache import graph_fingerprint; "
            "print(json.dumps({k: graph_fingerprint(g()) for k, g in start.graphs().items()}))")
    root = str(Path(__file__).resolve().parents[1])
    seen = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, root], env=dict(os.environ, PYTHONHASHSEED=seed),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert len(seen[0]) >= 7
    assert {k for k in seen[0] if seen[0][k] != seen[1][k]} == set()
