"""Task graphs for the decode megakernel.

A graph is one model's decode step at one batch bucket (1, 2, 4 or 8 rows), cut into tasks by
compiler.py from the model's step graph (stepgraph.py): tiles of fused ops (e.g. "LayerNorm + QKV projection + KV-cache append for output columns 64..127"). Tasks are
listed in a topological order. Each task may wait on up to two dependency counters (until each reaches
its target) and increments at most one counter when done; a task may also belong to a ticket
group, whose last member to finish runs the group's finale (Task.ticket). The persistent kernel (kernel.py) claims
tasks in list order, so any program only ever waits on tasks claimed before its own.

Every task also declares the state regions it reads and writes (buffer name, [start, end) in
elements), so checker.py can prove that every pair of conflicting accesses is ordered by the counters.
The host encodes the graph as an int64 table [num_tasks + finale rows, NUM_FIELDS], one row per task
(then the finale rows: TaskGraph.rows); unused fields hold -1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Batch sizes a decode graph is built for, declared once with the decode runtime (which imports
# without Triton); a batch of other size runs in the next bucket up.
from photon_core.runtime.decode import BATCH_BUCKETS, bucket_for  # noqa: F401  (re-exported)

# The op codes of the task table's "op" column are declared by the op modules that emit them
# (photon_core.megakernel.ops: OP_EMBED, OP_LINEAR, ..., OP_NAMES), and so are the store modes of
# OP_LINEAR (MODE_*) and the length sources of OP_ATTN_PARTIAL (LEN_*).

# Kernel op code -> name, filled by the op modules' rules when ops/ is imported (ops.OP_NAMES is
# this dict): the task table's op column, named without this module importing the ops.
OP_NAMES: dict[int, str] = {}

# Column of each field in the encoded task table: the one layout. kernel.py reads each field at its
# named offset (kernel.F_<field>, made from F); the op modules write them by name (Task.args).
FIELDS = ("op", "w0", "t0", "w1", "t1", "sig",
          "M", "K", "N", "n0", "x", "w", "b", "lnw", "lnb", "act", "res", "mode", "out",
          "kc", "vc", "H", "Dh", "Tmax", "tile", "part", "rb", "ntiles", "bi", "hi", "s", "S",
          "lenkind", "n1", "k0", "k1", "kpart", "ksplit", "ldw", "norm", "xglu",
          "xgate", "window", "ring", "scale", "xs", "xc0", "gact", "xact", "tau", "alpha", "sw", "chunk",
          "wsc", "loads", "ticket", "tickets", "lnst", "stx", "stn", "stout", "stkind", "kticket", "ktickets",
          "fin", "nfin", "rows", "prows", "stpart", "stnt", "sttile")
F = {name: i for i, name in enumerate(FIELDS)}
NUM_FIELDS = 80  # rows stay 128-byte aligned (640 bytes)
assert len(FIELDS) <= NUM_FIELDS

# Layout of the int32 dynamic buffer (per-step values, written by the host or by the kernel itself):
# [0:B] tokens, [B:2B] positions (of the token being decoded), [2B:3B] cross-attention lengths,
# [3B:4B] rotary offsets (rotary tables are read at position + offset: Qwen's multimodal positions
# run behind the cache position after an image).
DYN_TOKENS, DYN_POSITIONS, DYN_CROSS_LEN, DYN_ROTARY_OFFSET = 0, 1, 2, 3
DYN_SECTIONS = 4
# Layout of the int32 control buffer: [0] claim counter, [1] error flag (error_code: the failed task
# of lowest index and what failed), [2:2+C] dependency counters, then the tickets
# (TaskGraph.tickets). All of it must be zero at launch.
CTRL_CLAIM, CTRL_ERROR, CTRL_COUNTERS = 0, 1, 2
# What a task can fail at (the error flag's low bits). A task whose wait gave up is skipped; one that
# met an index out of its table's range (a token, a position) read a clamped one instead; either
# way the launch's results are refused by the host (Megakernel.raise_for).
ERR_WAIT, ERR_OP, ERR_RANGE = 1, 2, 3
ERR_KINDS = {ERR_WAIT: "gave up waiting on its dependencies (a dependency was never signalled)",
             ERR_OP: "has an unknown op", ERR_RANGE: "read a token or position outside its table (clamped)"}


# A traced launch's row per task (Megakernel.traced_launch, timeline.py), in the kernel's order, in
# rows of TRACE_WIDTH int64 (the rest spare); after the rows, the interpreter's logical clock.
TRACE_COLUMNS = ("program", "sm", "claimed", "waited", "ran", "released", "status")
TRACE_WIDTH = 8


def error_code(num_tasks: int, task: int, kind: int) -> int:
    """The error flag a failing task raises the flag to (atomic max): the LOWEST failing task wins,
    because tasks run in a topological order, so a failure's root has a lower index than every
    task it made fail in turn (a wait that gave up makes its waiters' waits give up too)."""
    return (num_tasks - task) * 4 + kind


def decode_error(num_tasks: int, flag: int) -> tuple[int, int]:
    """(task, kind) of an error flag (0: none, not to be decoded)."""
    return num_tasks - flag // 4, flag % 4


@dataclass(frozen=True)
class Region:
    buffer: str
    start: int
    end: int

    def overlaps(self, other: "Region") -> bool:
        return self.buffer == other.buffer and self.start < other.end and other.start < self.end


@dataclass
class Task:
    name: str
    op: int
    args: dict[str, int]
    waits: list[tuple[str, int]] = field(default_factory=list)
    signal: str | None = None
    reads: list[Region] = field(default_factory=list)
    writes: list[Region] = field(default_factory=list)
    # A ticket groups tasks of which whichever finishes LAST also runs a finale (the attention
    # merge; the row statistics of a value a norm reads): each member, its own work done, takes a ticket (an acq_rel atomic increment) and the
    # one that draws the group's size - 1 runs the finale before it signals. Every member declares
    # the finale's accesses (any of them may be last); checker.check orders them after all members.
    ticket: str | None = None
    last_reads: list[Region] = field(default_factory=list)
    last_writes: list[Region] = field(default_factory=list)
    # A second ticket, drawn BEFORE `ticket`: the K slices of one split-K tile, whose last to finish
    # sums the slices and runs the tile's epilogue (its accesses: ksum_reads / ksum_writes). A
    # member that ran it has done so before it takes the stage's `ticket`, so the stage's finale
    # (row statistics) follows every tile's sum.
    kticket: str | None = None
    ksum_reads: list[Region] = field(default_factory=list)
    ksum_writes: list[Region] = field(default_factory=list)


@dataclass
class Arena:
    """Bump allocator of named regions inside one flat buffer of `unit`-byte elements (fp32: 4,
    bf16: 2). A region may hold another dtype (FP8 experts as bytes, their fp32 scales in a bf16
    arena, bf16 KV caches in the fp32 state): it spans enough units, and the kernel reads it
    through a pointer of its own dtype at `toff` (the offset in elements of that dtype)."""
    name: str
    size: int = 0
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)
    unit: int = 4
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)   # regions not of the arena's dtype

    def alloc(self, key: str, numel: int, align: int = 16, dtype: torch.dtype | None = None) -> int:
        if key in self.regions:
            raise KeyError(f"{self.name}: region {key!r} allocated twice")
        off = -(-self.size // align) * align
        units = numel
        if dtype is not None and dtype.itemsize != self.unit:
            if (off * self.unit) % dtype.itemsize:
                raise ValueError(f"{self.name}: region {key!r} would not be aligned for {dtype}")
            self.dtypes[key] = dtype
            units = -(-numel * dtype.itemsize // self.unit)
        self.regions[key] = (off, units)
        self.size = off + units
        return off

    def off(self, key: str) -> int:
        return self.regions[key][0]

    def toff(self, key: str) -> int:
        """The region's offset in elements of its own dtype (what a task addresses it by)."""
        dt = self.dtypes.get(key)
        return self.regions[key][0] if dt is None else self.regions[key][0] * self.unit // dt.itemsize

    def numel(self, key: str) -> int:
        """Elements of the region's own dtype it holds."""
        dt = self.dtypes.get(key)
        return self.regions[key][1] if dt is None else self.regions[key][1] * self.unit // dt.itemsize

    def typed(self, buf: torch.Tensor, key: str) -> torch.Tensor:
        """The region of `buf` (this arena's flat buffer) as a flat tensor of the region's dtype."""
        dt = self.dtypes.get(key)
        if dt is None:
            off, n = self.regions[key]
            return buf[off:off + n]
        return buf.view(dt)[self.toff(key):self.toff(key) + self.numel(key)]

    def region(self, key: str, start: int = 0, end: int | None = None) -> Region:
        off, numel = self.regions[key]
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise ValueError(f"{self.name}: [{start}, {end}) is outside region {key!r} of {numel}")
        return Region(self.name, off + start, off + end)

    def columns(self, key: str, batch: int, width: int, c0: int, c1: int) -> list[Region]:
        """Columns [c0, c1) of every row of a row-major [batch, width] region."""
        return [self.region(key, r * width + c0, r * width + c1) for r in range(batch)]


class StateViews:
    """Named tensor views into a model megakernel's state arena. The class sets `state` (the flat
    fp32 buffer), `sarena` (its Arena) and `shapes` (region name -> shape)."""

    state: torch.Tensor
    sarena: Arena
    shapes: dict[str, tuple[int, ...]]

    def view(self, key: str) -> torch.Tensor:
        """A state region as a tensor view (e.g. "logits", "x", a layer's KV cache, in its dtype)."""
        shape = self.shapes[key]
        n = 1
        for s in shape:
            n *= s
        return self.sarena.typed(self.state, key)[:n].view(shape)

    @property
    def logits(self) -> torch.Tensor:
        """[B, vocab] LM logits of the last step (logit bias included, where the graph has one)."""
        return self.view("logits")


@dataclass(frozen=True)
class CacheLayout:
    """Where one KV cache (one layer of a layered one) lies in the state arena, for the checker:
    tasks declare its accesses in a namespace of its own ("{key}@cols", ops/base.py cache_cols)
    but address it at `toff` (their kc / vc: elements of `itemsize` bytes into `buffer`, an arena
    of `unit`-byte elements), as [batch, heads, length, head_dim]."""
    buffer: str
    unit: int
    toff: int
    itemsize: int
    heads: int
    length: int
    head_dim: int

    def byte_span(self, batch: int) -> tuple[int, int]:
        return self.toff * self.itemsize, (self.toff + batch * self.heads * self.length * self.head_dim) * self.itemsize


@dataclass
class TaskGraph:
    model: str
    batch: int
    tasks: list[Task] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    tickets: dict[str, int] = field(default_factory=dict)
    # Finale rows: work a ticket's last member runs (a kv_append's (row, head) tasks behind their
    # q|k|v tiles), encoded after the tasks and never claimed. A member's arguments `fin` (index
    # here of the first) and `nfin` (how many) name them; their waits, signal and accesses are the
    # members' (the accesses declared as the ticket's finale's).
    rows: list[Task] = field(default_factory=list)
    # Each cache namespace ("{key}@cols") -> its CacheLayout, set by compiler.lower (checker.check
    # proves the caches disjoint from the state the tasks declare). Not kept by graph_file: a graph
    # read back from the build cache was proven when it was built, and compares equal without it.
    caches: dict[str, CacheLayout] = field(default_factory=dict, compare=False)

    def counter(self, name: str) -> str:
        self.counters.setdefault(name, len(self.counters))
        return name

    def ctrl_size(self) -> int:
        """int32 elements of the control buffer: claim, error, counters, tickets."""
        return CTRL_COUNTERS + max(1, len(self.counters)) + len(self.tickets)

    def add(self, task: Task) -> Task:
        for c, _ in task.waits:
            self.counter(c)
        if task.signal is not None:
            self.counter(task.signal)
        for ticket in (task.kticket, task.ticket):
            if ticket is not None:
                self.tickets.setdefault(ticket, len(self.tickets))
        self.tasks.append(task)
        return task

    def signalers(self, counter: str) -> int:
        return sum(1 for t in self.tasks if t.signal == counter)

    def encode(self) -> torch.Tensor:
        """The int64 table the kernel reads; call checker.check(graph) first."""
        table = torch.full((len(self.tasks) + len(self.rows), NUM_FIELDS), -1, dtype=torch.int64)
        members: dict[str, int] = {}
        for t in self.tasks:
            for ticket in (t.kticket, t.ticket):
                if ticket is not None:
                    members[ticket] = members.get(ticket, 0) + 1
        ticket0 = CTRL_COUNTERS + max(1, len(self.counters))
        for i, t in enumerate(self.tasks):
            if len(t.waits) > 2:
                raise ValueError(f"task {t.name}: at most two waits are encoded, got {len(t.waits)}")
            row = table[i]
            row[F["op"]] = t.op
            for j, (c, target) in enumerate(t.waits):
                row[F[f"w{j}"]] = self.counters[c]
                row[F[f"t{j}"]] = target
            if t.signal is not None:
                row[F["sig"]] = self.counters[t.signal]
            for key, ticket in (("ticket", t.ticket), ("kticket", t.kticket)):
                if ticket is not None:   # the ticket's index in the control buffer, and its group's size
                    row[F[key]] = ticket0 + self.tickets[ticket]
                    row[F[key + "s"]] = members[ticket]
            self._encode_args(t, row, i)
        for i, t in enumerate(self.rows, len(self.tasks)):
            if t.waits or t.signal is not None or t.ticket is not None or t.kticket is not None:
                raise ValueError(f"finale row {t.name}: waits, signals and tickets are its task's")
            table[i, F["op"]] = t.op
            self._encode_args(t, table[i], i)
        return table

    def _encode_args(self, t: Task, row: torch.Tensor, i: int) -> None:
        if t.args.get("stout", -1) >= 0 and "fin" in t.args:
            raise ValueError(f"task {t.name}: one finale per ticket (row statistics or finale rows)")
        for k, v in t.args.items():
            if k not in F or F[k] < F["M"] or k in ("ticket", "tickets", "kticket", "ktickets"):
                raise KeyError(f"task {t.name}: unknown argument {k!r}")
            if k == "fin":   # finale rows are addressed from the row that runs them, in elements
                if not 0 <= v < len(self.rows) or not 0 < t.args["nfin"] <= len(self.rows) - v:
                    raise ValueError(f"task {t.name}: finale rows [{v}, +{t.args['nfin']}) of {len(self.rows)}")
                v = (len(self.tasks) + v - i) * NUM_FIELDS
            row[F[k]] = int(v)

    def summary(self) -> str:
        by_op: dict[str, int] = {}
        for t in self.tasks:
            by_op[OP_NAMES.get(t.op, str(t.op))] = by_op.get(OP_NAMES.get(t.op, str(t.op)), 0) + 1
        return (f"{self.model} batch {self.batch}: {len(self.tasks)} tasks (+ {len(self.rows)} finale rows), "
                f"{len(self.counters)} counters, "
                + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items())))
