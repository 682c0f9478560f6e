"""Part "liveness": a wait nobody signals, with a small spin limit, launched in a child process with
a timeout: the launch must return and raise_on_error must name that task (a hang fails the check
instead of hanging the proof). The child is `python -m photon_core.gpu_proof.liveness`,
started at the beginning of a run (start) and collected in its part (finish)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from photon_core.gpu_proof.build import copy_graph, unchecked_kernel
from photon_core.gpu_proof.checks import Ctx


def start(ctx: Ctx) -> tuple[subprocess.Popen, float]:
    """Start the child (it compiles and launches a kernel of its own, so it runs beside the builds)."""
    env = dict(os.environ)
    if ctx.cuda:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "photon_core.gpu_proof.liveness"] + (["--dry-run"] if not ctx.cuda else [])
    # The child imports photon_core from where this process did (a checkout, not an install).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), time.time()


def finish(ctx: Ctx, started: tuple[subprocess.Popen, float]) -> dict:
    """The child's verdict: it must answer within the liveness timeout (counted from its start)."""
    proc, t = started
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, ctx.sizes.liveness_timeout_s - (time.time() - t)))
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else dict(ok=False, message=stderr[-2000:])
        res["exit"] = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        res = dict(ok=False, message=f"no answer in {ctx.sizes.liveness_timeout_s} s: the launch hangs")
    res["seconds"] = round(time.time() - t, 1)
    ctx.checks.expect(bool(res.get("ok")) and res.get("exit") == 0, f"liveness: {res}")
    print(f"  never-signalled wait: {'returned and raised' if res.get('ok') else 'FAILED'} "
          f"({(res.get('message') or '')[:160]}), launch {res.get('launch_s', '?')} s, child {res['seconds']} s "
          "(started before the builds)", flush=True)
    return res


def liveness_child(dry: bool) -> int:
    import torch

    from photon_core.megakernel.compiler import Tiling
    from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights
    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, 16, seed=0, device=dev)
    step = WhisperDecoderMegakernel(wt, 1, 16, 8, Tiling(32, 64, 16, 2, 2))
    step.set_cross_kv([(torch.randn(1, 2, 8, 32, device=dev), torch.randn(1, 2, 8, 32, device=dev))])
    step.set_step([3], [2])
    g = copy_graph(step.graph)
    i = next(j for j, t in enumerate(g.tasks) if t.waits)
    g.counter("never-signalled")
    g.tasks[i].waits = [("never-signalled", 1)]
    bad = unchecked_kernel(step.kernel, g)
    bad.spin_limit = 1 << 12 if cuda else 2
    t = time.perf_counter()
    bad.launch()
    if cuda:
        torch.cuda.synchronize()
    launch_s = time.perf_counter() - t
    try:
        bad.raise_on_error()
        message = None
    except RuntimeError as e:
        message = str(e)
    ok = message is not None and "gave up waiting" in message and f"task {i} " in message
    print(json.dumps(dict(ok=ok, task=i, name=g.tasks[i].name, message=message, launch_s=round(launch_s, 3),
                          programs=bad.num_programs, spin_limit=bad.spin_limit, device=str(dev))), flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    dry = "--dry-run" in sys.argv[1:]
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"    # before triton is first imported
    sys.exit(liveness_child(dry))
