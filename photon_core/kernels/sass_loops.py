"""What a compiled kernel's weight-streaming loops do, read from its SASS (compile-only evidence).

A decode step streams weights; how fast a K loop can pull them is set by how many bytes each of
its trips has in flight before it must wait for the first of them (Little's law: bytes in flight /
latency). That is visible without a GPU in the machine code ptxas emitted: this module
disassembles a cubin (`nvdisasm -gi`, next to Triton's ptxas), finds the loops (a backward branch
and its target) that hold weight loads (global loads whose source line is one of `sites`), and
reports per loop and trip, per thread:

* `weight_bytes`: bytes the weight loads move (LDG.E.128 16, .64 8, plain 4, .U16 2, .U8 1);
* `in_flight_bytes`: of those, the bytes issued before the first instruction that reads a register
  any of them loaded (in SASS order: what the scheduler can have outstanding at once, trip by trip);
* `loads`: weight loads by width; `barriers`: BAR instructions; `shared`: LDS/STS/LDSM (a layout
  change through shared memory shows as stores, a barrier and loads inside the loop); `local`:
  LDL/STL, a spill's traffic inside the trip (a kernel's stack may be spilled off the loops);
* `ahead`: in a software-pipelined loop (copies into shared memory, cp.async: LDGSTS), the later
  trips whose copies are still in flight when a trip waits for its own: the wait's count of
  outstanding commit groups (DEPBAR.LE SB0, N) over the groups a trip commits (LDGDEPBAR). A
  trip consumes its copies from shared memory while `ahead` trips' weights stream (0: no such
  loop).

The figures are per thread; a program moves `threads` (num_warps x 32) times them. Loads ptxas
hoisted out of a loop (a pipelined loop's prologue) are not in its trips; copies into shared memory
(cp.async: LDGSTS) count as weight loads, in flight until the first wait on them (DEPBAR). Each loop
is named by the task function its weight loads were inlined from (the -gi records); a ptxas that
keeps none (Triton 3.6's 12.8) leaves only line numbers, and the loop is named by the nearest task
function laid out after it, which tells dense linear loops from MoE ones but not _task_linear's
from _task_linear_split's (the same loop, inlined twice).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# The megakernel's weight loads: the lines of kernel.py that hold both strings.
WEIGHT_LOAD = ("tl.load(w_ptr", "w_off")
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
_LOC = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)(?:\.64)?\b")


@dataclass
class Insn:
    address: int
    opcode: str
    operands: list[str]
    file: str
    line: int                # the innermost source line (an inlined function's own)
    chain: tuple[int, ...]   # that line, then each line it was inlined at, outwards


@dataclass
class Loop:
    """One loop's trip (per thread)."""
    start: int
    end: int
    lines: tuple[int, ...]                    # weight-load source lines inside
    callers: tuple[str, ...] = ()             # the functions its first weight load was inlined through, inwards
    loads: dict[str, int] = field(default_factory=dict)
    weight_bytes: int = 0
    in_flight_bytes: int = 0
    barriers: int = 0
    shared: int = 0
    local: int = 0                            # local-memory loads and stores (spills) inside a trip
    ahead: int = 0                            # later trips' copies in flight at a trip's wait (cp.async loops)

    @property
    def task(self) -> str:
        """The task function the loop belongs to (kernel.py's `_task_<op>`), or its outermost caller."""
        return next((c for c in self.callers if c.startswith("_task_")), self.callers[0] if self.callers else "?")


@contextmanager
def on_disk(cubin: bytes) -> Iterator[Path]:
    """A cubin as a file, for the CUDA tools that read only files (nvdisasm, cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        yield path


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    with on_disk(cubin) as path:
        r = subprocess.run([nvdisasm, "-gi", "-c", str(path)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {r.stderr[-2000:]}")
    return r.stdout


def instructions(sass: str) -> tuple[list[Insn], dict[str, int]]:
    """The instructions, each with its source location (nvdisasm -gi prints, before a run of
    instructions, the innermost line first, then the lines it was inlined at), and the labels'
    addresses."""
    out: list[Insn] = []
    labels: dict[str, int] = {}
    where: tuple[str, tuple[int, ...]] = ("", (0,))
    group: list[tuple[str, int]] = []
    pending: list[str] = []
    for text in sass.splitlines():
        loc = _LOC.search(text)
        if loc:
            group.append((loc.group(1), int(loc.group(2))))
            continue
        if group:
            where, group = (group[0][0], tuple(line for _, line in group)), []
        label = re.match(r"\s*(\.L_x_\d+):", text)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSN.search(text)
        if m:
            address = int(m.group(1), 16)
            labels.update((p, address) for p in pending)
            pending = []
            ops = [o.strip() for o in m.group(4).split(",")] if m.group(4).strip() else []
            out.append(Insn(address, m.group(3), ops, where[0], where[1][0], where[1]))
    return out, labels


def _load_bytes(opcode: str) -> int:
    for part in opcode.split(".")[1:]:
        if part in _WIDTH:
            return _WIDTH[part]
    return 4


def _dest_regs(insn: Insn) -> set[int]:
    m = _REG.search(insn.operands[0]) if insn.operands else None
    if m is None:
        return set()
    first, count = int(m.group(1)), max(1, _load_bytes(insn.opcode) // 4)
    return set(range(first, first + count))


def _source_regs(insn: Insn) -> set[int]:
    """Registers an instruction reads, counted wide where it may read several from one name (a
    vector store's data, a tensor-core multiply's fragments): overcounting reads can only shorten
    what is counted in flight."""
    stores = insn.opcode.startswith(("ST", "RED", "ATOM"))
    mma = insn.opcode.startswith(("HMMA", "IMMA", "HGMMA", "DMMA"))
    vector = max(1, _load_bytes(insn.opcode) // 4) if stores or insn.opcode.startswith("LD") else 1
    regs: set[int] = set()
    for op in insn.operands[0 if stores else 1:]:
        for m in _REG.finditer(op):
            first = int(m.group(1))
            inside_address = "[" in op
            count = 4 if mma else (2 if ".64" in m.group(0) else (1 if inside_address else vector))
            regs.update(range(first, first + count))
    return regs


def is_weight_load(insn: Insn, file_suffix: str, sites: set[int]) -> bool:
    return insn.opcode.startswith("LDG") and not insn.opcode.startswith("LDGDEPBAR") and (
        insn.file.endswith(file_suffix) and insn.line in sites)


def loops(insns: list[Insn], labels: dict[str, int], file_suffix: str, sites: set[int],
          names: dict[int, str] | None = None) -> list[Loop]:
    """The innermost loops holding weight loads, in address order, with their trips' figures: a
    loop is a branch back to a label at or before it."""
    index = {i.address: n for n, i in enumerate(insns)}
    last_back: dict[int, int] = {}       # loop head -> the furthest branch back to it (a continue is nearer)
    for n, branch in enumerate(insns):
        if not branch.opcode.startswith("BRA") or not branch.operands:
            continue
        name = re.search(r"\.L_x_\d+", branch.operands[-1])
        start = labels.get(name.group(0)) if name else None
        if start is not None and start <= branch.address:
            last_back[start] = max(last_back.get(start, n), n)
    found = []
    for start, n in last_back.items():
        body = insns[index[start]:n + 1]
        if any(is_weight_load(i, file_suffix, sites) for i in body):
            found.append(body)
    innermost = [b for b in found
                 if not any(o is not b and b[0].address <= o[0].address and o[-1].address <= b[-1].address
                            and (o[0].address, o[-1].address) != (b[0].address, b[-1].address) for o in found)]
    names = names or {}
    out = []
    for body in innermost:
        loop = _trip(body, file_suffix, sites, names)
        if not any(c.startswith("_task_") for c in loop.callers):
            # No inlining records (older ptxas): the task is the nearest one after the loop.
            after = (names.get(i.line, "") for i in insns[index[body[-1].address]:] if i.file.endswith(file_suffix))
            task = next((n for n in after if n.startswith("_task_")), None)
            if task is not None:
                loop.callers = (task,) + loop.callers
        out.append(loop)
    return out


def _trip(body: list[Insn], file_suffix: str, sites: set[int], names: dict[int, str]) -> Loop:
    first = next(i for i in body if is_weight_load(i, file_suffix, sites))
    callers = tuple(dict.fromkeys(names.get(line, "?") for line in reversed(first.chain)))
    loop = Loop(body[0].address, body[-1].address,
                tuple(sorted({i.line for i in body if is_weight_load(i, file_suffix, sites)})), callers)
    pending: set[int] = set()
    waiting = False
    for i in body:
        if is_weight_load(i, file_suffix, sites):
            size = _load_bytes(i.opcode)
            loop.loads[i.opcode] = loop.loads.get(i.opcode, 0) + 1
            loop.weight_bytes += size
            if not waiting:
                loop.in_flight_bytes += size
                pending |= _dest_regs(i) if not i.opcode.startswith("LDGSTS") else {-1}
            continue
        # The first reader of a loaded register (or, for cp.async copies into shared memory, the
        # first wait on them) ends what the trip has in flight at once.
        if not waiting and pending and (_source_regs(i) & pending or i.opcode.startswith("DEPBAR")):
            waiting = True
        if i.opcode.startswith("BAR"):
            loop.barriers += 1
        if i.opcode.startswith(("LDS", "STS", "LDSM")):
            loop.shared += 1
        if i.opcode.startswith(("LDL", "STL")):
            loop.local += 1
    groups = sum(i.opcode == "LDGDEPBAR" for i in body)
    # DEPBAR.LE SB0, N[, {...}]: cp.async's commit groups count on scoreboard 0 (other
    # scoreboards wait for other things); the strictest wait in the trip
    waits = [int(i.operands[1], 0) for i in body
             if i.opcode.startswith("DEPBAR.LE") and len(i.operands) > 1 and i.operands[0] == "SB0"]
    if groups and waits and any(op.startswith("LDGSTS") for op in loop.loads):
        loop.ahead = min(waits) // groups
    return loop


def streaming_bytes(loop: dict) -> int:
    """Weight bytes a thread has in flight while a trip of `loop` (a compile_check record) waits or
    computes: a register loop's bytes issued before the first use; a pipelined loop's later trips'
    copies (ahead x a trip), the trip it waits for being done."""
    return loop["weight_bytes"] * loop["ahead"] if loop.get("ahead") else loop["in_flight_bytes"]


def dense_loops(loops: list[dict]) -> list[dict]:
    """Of compile_check's loop records (k_loops), every copy of the dense linear tasks' K loop."""
    return [lp for lp in loops if lp["task"] in ("_task_linear", "_task_linear_split")]


def expert_loops(loops: list[dict]) -> list[dict]:
    """Of compile_check's loop records (k_loops), the expert tasks' K loops (MoE up and down, of one
    column tile a task or several: _task_moe_up_tiles, _task_moe_down_tiles)."""
    return [lp for lp in loops if lp["task"] in ("_task_moe_up", "_task_moe_down", "_task_moe_up_tiles",
                                                 "_task_moe_down_tiles")]


def dense_loop(loops: list[dict]) -> dict:
    """Of compile_check's loop records (k_loops), the dense linear tasks' K loop: _task_linear and
    _task_linear_split inline the same loop (without inlining records both are named by the task
    laid out after them), which ptxas may schedule differently: the copy with less in flight."""
    dense = dense_loops(loops)
    if not dense or any(lp["loads"] != dense[0]["loads"] for lp in dense):
        raise ValueError(f"expected the dense linear K loops, with the same loads: {loops}")
    return min(dense, key=streaming_bytes)


def load_sites(text: list[str], marker: tuple[str, ...], names: dict[int, str]) -> set[int]:
    """The source lines whose global loads are weight loads: each line holding every string of
    `marker`, and every line of a leaf function (one calling no other function of `text`) whose
    loads are all such lines. ptxas's line records can name a line after the load's own (Triton
    3.9 put the FP8 experts' byte loads in _w_tile three lines down, past its last line): within
    such a function no other load can be meant."""
    sites = {n + 1 for n, line in enumerate(text) if all(m in line for m in marker)}
    defined = {f for f in names.values() if f != "?"}
    calls = re.compile(r"\b(" + "|".join(map(re.escape, sorted(defined))) + r")\(") if defined else None
    loads: dict[str, list[bool]] = {}
    callers: set[str] = set()
    for n, line in enumerate(text, 1):
        if "tl.load(" in line:
            loads.setdefault(names[n], []).append(n in sites)
        if calls is not None and not line.lstrip().startswith("def ") and calls.search(line):
            callers.add(names[n])
    only = {f for f, weight in loads.items() if all(weight) and f != "?" and f not in callers}
    return sites | {n for n, f in names.items() if f in only}


def enclosing_functions(lines: list[str]) -> dict[int, str]:
    """Source line (1-based) -> the name of the top-level function it lies in."""
    out, name = {}, "?"
    for n, line in enumerate(lines, 1):
        m = re.match(r"def (\w+)", line)
        if m:
            name = m.group(1)
        elif line and not line[0].isspace() and not line.startswith(("@", "#", ")")):
            name = "?"
        out[n] = name
    return out
